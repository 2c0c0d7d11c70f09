"""Workload for the no-CFI unwinder tests (tests/test_nocfi_bpf.py).

    python nocfi.py EXTENSION.so SECONDS

The main thread alternates, 100 ms each, between
  spin_case():  nocfi.spin()  -> nf_outer -> nf_middle -> nocfi_spin (asm, no CFI)
  call_case():  nocfi.call()  -> nf_outer_cb -> nf_middle_cb -> nocfi_call (asm, no CFI)
                -> nf_callback (C)
  rbp_case():   nocfi.rbp()   -> nf_fp_outer -> nf_fp_middle (frame pointers) -> nocfi_rbp
                (asm, no CFI, takes rbp)
  realign_case(): nocfi.realign() -> nf_outer_ra -> nf_drap (stack realigned: DRAP)
                -> nocfi_realign (asm, no CFI, rsp kept in rbx)
and a pthread (no Python state) runs nf_thread -> nf_th_outer -> nf_middle ->
nocfi_spin.  Prints "cthread TID", then "ready".
"""
import importlib.machinery
import importlib.util
import sys
import time


def load(path):
    loader = importlib.machinery.ExtensionFileLoader("nocfi", path)
    spec = importlib.util.spec_from_file_location("nocfi", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def spin_case(m):
    m.spin(0.100)


def call_case(m):
    m.call(0.100)


def rbp_case(m):
    m.rbp(0.100)


def realign_case(m):
    m.realign(0.100)


def main():
    m = load(sys.argv[1])
    end = time.monotonic() + float(sys.argv[2])
    print("cthread", m.start_thread(), flush=True)
    print("ready", flush=True)
    while time.monotonic() < end:
        spin_case(m)
        call_case(m)
        rbp_case(m)
        realign_case(m)


if __name__ == "__main__":
    main()
