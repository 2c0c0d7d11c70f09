"""Threads that block before the profiler attaches and never wake up: argv[1]
threads parked in `parked` on an Event, the main thread in time.sleep."""
import sys
import threading
import time

never = threading.Event()


def parked():
    never.wait()


def main():
    for i in range(int(sys.argv[1])):
        threading.Thread(target=parked, name="parked-%d" % i, daemon=True).start()
    print("ready", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
