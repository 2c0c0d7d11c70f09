"""Two threads ping-ponging a byte over pipes, thousands of switches a
second. The `ponger` blocks alternately in read_a and read_b: the same C
call from two Python functions, so the same user PC and stack pointer at
every switch, with a different innermost Python frame."""
import os
import threading

a_r, a_w = os.pipe()
b_r, b_w = os.pipe()


def read_a():
    return os.read(a_r, 1)


def read_b():
    return os.read(a_r, 1)


def ponger():
    n = 0
    while True:
        (read_a if n % 2 == 0 else read_b)()
        n += 1
        os.write(b_w, b"x")


def main():
    threading.Thread(target=ponger, name="ponger", daemon=True).start()
    print("ready", flush=True)
    while True:
        os.write(a_w, b"x")
        os.read(b_r, 1)


if __name__ == "__main__":
    main()
