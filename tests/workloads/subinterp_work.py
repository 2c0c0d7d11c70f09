"""The function subinterps.py's InterpreterPoolExecutor runs in each worker's
subinterpreter (imported there: it must be a module, not __main__)."""


def pool_spin():
    n = 0
    while True:
        n += 1
