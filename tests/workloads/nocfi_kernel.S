/* Kernels in assembly without any CFI (no .cfi_* directive, so no FDE in
 * .eh_frame), the way hand-written BLAS kernels ship: callee-saved pushes,
 * a frame below them, a loop, the frame given back.  For the unwinder's
 * no-CFI tests (tests/workloads/nocfi.c, tests/test_nocfi_bpf.py).
 *
 *   unsigned long nocfi_spin(unsigned long iters)
 *       loops iters times.
 *   unsigned long nocfi_call(unsigned long iters, unsigned long (*fn)(void))
 *       loops iters times, calling fn() every 4096 iterations.
 *   unsigned long nocfi_rbp(unsigned long iters)
 *       takes rbp for a pointer of its own, the caller's rbp kept in r12
 *       (where no unwinder can know it is): its caller's rbp is lost in its
 *       body, and rbp points at an older frame (its caller's caller's): a
 *       walk that believed it would skip a frame.
 *   unsigned long nocfi_realign(unsigned long iters)
 *       OpenBLAS's GEMM kernels' shape: callee-saved registers kept with mov
 *       in a frame, rsp copied to rbx and the stack aligned to 4 KiB, rbp
 *       taken for a pointer of its own; a loop whose body jumps forward and
 *       back, so the rule must follow the control flow, not a straight line.
 */
/* -DNOCFI_HIDDEN: hidden symbols, so that a stripped build names none of
 * them (the kernels are then code no symbol and no FDE covers) */
#ifdef NOCFI_HIDDEN
#define EXPORT(f) .globl f; .hidden f
#else
#define EXPORT(f) .globl f
#endif

        .text
        EXPORT(nocfi_spin)
        .type   nocfi_spin, @function
        .p2align 4
nocfi_spin:
        pushq   %rbx
        pushq   %r12
        pushq   %r13
        subq    $40, %rsp
        movq    %rdi, %rbx
        movq    $1, %rax
        movq    $6364136223846793005, %r12
1:      imulq   %r12, %rax
        addq    %rbx, %rax
        movq    %rax, 8(%rsp)
        decq    %rbx
        jnz     1b
        addq    $40, %rsp
        popq    %r13
        popq    %r12
        popq    %rbx
        ret
        .size   nocfi_spin, .-nocfi_spin

        EXPORT(nocfi_call)
        .type   nocfi_call, @function
        .p2align 4
nocfi_call:
        pushq   %rbp
        pushq   %rbx
        pushq   %r12
        subq    $32, %rsp
        movq    %rdi, %rbx
        movq    %rsi, %rbp
        xorl    %r12d, %r12d
1:      incq    %r12
        testq   $4095, %r12
        jnz     2f
        call    *%rbp
2:      movq    %r12, 16(%rsp)
        decq    %rbx
        jnz     1b
        movq    %r12, %rax
        addq    $32, %rsp
        popq    %r12
        popq    %rbx
        popq    %rbp
        ret
        .size   nocfi_call, .-nocfi_call

        EXPORT(nocfi_rbp)
        .type   nocfi_rbp, @function
        .p2align 4
nocfi_rbp:
        pushq   %r12
        subq    $16, %rsp
        movq    %rbp, %r12
        movq    (%rbp), %rbp            /* its caller's saved rbp: an older, real frame, as a
                                           pointer to a caller's stack buffer would be */
1:      movq    %rdi, 8(%rsp)
        movq    (%rbp), %rax
        decq    %rdi
        jnz     1b
        movq    %r12, %rbp
        addq    $16, %rsp
        popq    %r12
        ret
        .size   nocfi_rbp, .-nocfi_rbp

        EXPORT(nocfi_realign)
        .type   nocfi_realign, @function
        .p2align 4
nocfi_realign:
        subq    $56, %rsp
        movq    %rbx, (%rsp)
        movq    %rbp, 8(%rsp)
        movq    %r12, 16(%rsp)
        vzeroupper
        movq    %rsp, %rbx
        subq    $8192, %rsp
        andq    $-4096, %rsp
        movq    %rsp, %rbp              /* rbp: the aligned buffer, not a frame */
        movq    $1, %rax
        movq    $6364136223846793005, %r12
        jmp     2f
1:      imulq   %r12, %rax
        movq    %rax, 64(%rbp)
        testq   $1, %rdi
        jz      3f
        addq    %rdi, %rax
        jmp     3f
2:      testq   %rdi, %rdi
        jnz     1b
        jmp     4f
3:      decq    %rdi
        jmp     2b
4:      movq    %rbx, %rsp
        movq    16(%rsp), %r12
        movq    8(%rsp), %rbp
        movq    (%rsp), %rbx
        addq    $56, %rsp
        ret
        .size   nocfi_realign, .-nocfi_realign

        .section .note.GNU-stack,"",@progbits
