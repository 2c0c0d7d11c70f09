"""A plain PyTorch training loop, as people run one (issue 23's workload):
a DataLoader with worker processes feeding an MLP (forward, backward, SGD
step) on the CPU, and a logger thread that sleeps and writes.

    python torch_train.py SECONDS [WORKERS]

Prints `ready` once the first step is done, then `steps N` every second
(to stdout, flushed: the bench counts training steps/s from it)."""
import os
import sys
import threading
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Samples(Dataset):
    """Synthetic samples, made in the worker: __getitem__ costs CPU there."""

    def __len__(self):
        return 1 << 30

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(256, generator=g)
        for _ in range(20):                 # some per-sample preprocessing
            x = torch.tanh(x * 1.01 + 0.01)
        return x, int(i % 10)


def collate(batch):
    xs = torch.stack([b[0] for b in batch])
    ys = torch.tensor([b[1] for b in batch])
    return xs, ys


def logger(stop, log):
    while not stop.is_set():
        time.sleep(0.2)
        log.write(f"{time.time():.3f} alive\n")
        log.flush()


def train(model, loader, seconds, report):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    steps = 0
    end = time.monotonic() + seconds
    next_report = time.monotonic() + 1.0
    for x, y in loader:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        steps += 1
        if steps == 1:
            report("ready")
        now = time.monotonic()
        if now >= next_report:
            next_report = now + 1.0
            report(f"steps {steps} {now:.3f}")
        if now >= end:
            break
    return steps


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.manual_seed(0)
    # wide enough that a step is mostly the model's own work (as in real
    # training), not the DataLoader's hand-over of the batch
    model = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                          nn.Linear(2048, 10))
    loader = DataLoader(Samples(), batch_size=128, num_workers=workers, collate_fn=collate,
                        persistent_workers=workers > 0)
    stop = threading.Event()
    log = open(os.devnull, "w")
    t = threading.Thread(target=logger, args=(stop, log), name="logger", daemon=True)
    t.start()

    def report(line):
        print(line, flush=True)
    steps = train(model, loader, seconds, report)
    stop.set()
    report(f"done {steps}")


if __name__ == "__main__":
    main()
