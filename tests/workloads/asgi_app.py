"""A FastAPI app under uvicorn whose handler does ~CPU_S of CPU work, then
awaits a local slow dependency: a TCP server (a thread here) that answers
each line after DEP_DELAY_S.  Prints `port N` and `ready` once it serves.
argv: seconds to live."""
import asyncio
import socket
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI

CPU_S = 0.002
DEP_DELAY_S = 0.030


def dependency(sock):
    def serve(conn):
        with conn:
            f = conn.makefile("rwb")
            for line in f:
                time.sleep(DEP_DELAY_S)
                f.write(line)
                f.flush()
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


dep = socket.socket()
dep.bind(("127.0.0.1", 0))
dep.listen(64)
DEP_PORT = dep.getsockname()[1]
threading.Thread(target=dependency, args=(dep,), daemon=True).start()

app = FastAPI()


def compute(seconds):
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1
    return x


@app.get("/work")
async def work():
    compute(CPU_S)
    reader, writer = await asyncio.open_connection("127.0.0.1", DEP_PORT)
    writer.write(b"x\n")
    await writer.drain()
    await reader.readline()                 # the slow dependency answers
    writer.close()
    return {"ok": True}


async def main(seconds):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[s]))
    while not server.started:
        await asyncio.sleep(0.01)
    print("port", port, flush=True)
    print("ready", flush=True)
    await asyncio.sleep(seconds)
    server.should_exit = True
    await task


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1]) if len(sys.argv) > 1 else 3600))
