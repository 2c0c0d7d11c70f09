"""A C++ inference runtime for the native unwinder: ONNX Runtime running a
four-layer MLP (MatMul + Relu, 256x512 by 512x512) in a loop on a thread,
its own intra-op pool of two threads beside it.  Its MLAS kernels are
assembly with neither CFI nor symbols in a stripped library.  Prints "ready"
once inference runs; runs until killed or for argv[1] seconds."""
import sys
import threading
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

N, LAYERS = 512, 4


def model() -> bytes:
    nodes, weights, prev = [], [], "x"
    for i in range(LAYERS):
        weights.append(numpy_helper.from_array(np.random.rand(N, N).astype(np.float32) / N, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [f"r{i}"]))
        prev = f"r{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, N])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [None, N])], weights)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m.SerializeToString()


def infer_loop(session, stop):
    x = np.random.rand(256, N).astype(np.float32)
    while not stop.is_set():
        session.run(None, {"x": x})


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3600.0
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    session = ort.InferenceSession(model(), opts, providers=["CPUExecutionProvider"])
    stop = threading.Event()
    t = threading.Thread(target=infer_loop, args=(session, stop), name="infer")
    t.start()
    time.sleep(0.5)
    print("ready", flush=True)
    time.sleep(seconds)
    stop.set()
    t.join()


if __name__ == "__main__":
    main()
