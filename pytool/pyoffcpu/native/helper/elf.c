#include "elf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int elf_open_fd(struct elf_file *f, int fd, char *err, size_t errlen)
{
    struct stat st;
    memset(f, 0, sizeof(*f));
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "not a regular file");
        return -1;
    }
    if ((size_t)st.st_size < sizeof(Elf64_Ehdr)) {
        snprintf(err, errlen, "too short for ELF");
        return -1;
    }
    void *m = mmap(0, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
        snprintf(err, errlen, "cannot map the file");
        return -1;
    }
    f->data = m;
    f->size = (size_t)st.st_size;
    f->eh = (const Elf64_Ehdr *)f->data;
    const unsigned char *id = f->eh->e_ident;
    if (memcmp(id, ELFMAG, SELFMAG) != 0 || id[EI_CLASS] != ELFCLASS64 || id[EI_DATA] != ELFDATA2LSB) {
        snprintf(err, errlen, "not a 64-bit little-endian ELF file");
        elf_close(f);
        return -1;
    }
    uint64_t shoff = f->eh->e_shoff;
    unsigned shnum = f->eh->e_shnum;
    if (shoff && shnum && f->eh->e_shentsize == sizeof(Elf64_Shdr)
            && shoff <= f->size && (uint64_t)shnum * sizeof(Elf64_Shdr) <= f->size - shoff) {
        if (shoff % _Alignof(Elf64_Shdr) == 0) {
            f->sh = (const Elf64_Shdr *)(f->data + shoff);
        } else {
            /* a table at an odd offset: read through an aligned copy */
            Elf64_Shdr *copy = malloc((size_t)shnum * sizeof(Elf64_Shdr));
            if (!copy) {
                snprintf(err, errlen, "out of memory");
                elf_close(f);
                return -1;
            }
            memcpy(copy, f->data + shoff, (size_t)shnum * sizeof(Elf64_Shdr));
            f->sh = copy;
            f->sh_copy = copy;
        }
        f->shnum = shnum;
        unsigned si = f->eh->e_shstrndx;
        const unsigned char *p;
        size_t n;
        if (si < shnum && elf_section_data(f, &f->sh[si], &p, &n) == 0) {
            f->shstr = (const char *)p;
            f->shstr_size = n;
        }
    }
    return 0;
}

void elf_close(struct elf_file *f)
{
    if (f->data)
        munmap((void *)f->data, f->size);
    free(f->sh_copy);
    memset(f, 0, sizeof(*f));
}

const char *elf_section_name(const struct elf_file *f, unsigned i)
{
    if (i >= f->shnum || !f->shstr)
        return "";
    uint32_t off = f->sh[i].sh_name;
    if (off >= f->shstr_size || !memchr(f->shstr + off, 0, f->shstr_size - off))
        return "";
    return f->shstr + off;
}

const Elf64_Shdr *elf_section(const struct elf_file *f, const char *name)
{
    for (unsigned i = 0; i < f->shnum; i++)
        if (strcmp(elf_section_name(f, i), name) == 0)
            return &f->sh[i];
    return 0;
}

int elf_section_data(const struct elf_file *f, const Elf64_Shdr *s,
                     const unsigned char **p, size_t *n)
{
    if (s->sh_type == SHT_NOBITS || (s->sh_flags & SHF_COMPRESSED))
        return -1;
    if (s->sh_offset > f->size || s->sh_size > f->size - s->sh_offset)
        return -1;
    *p = f->data + s->sh_offset;
    *n = s->sh_size;
    return 0;
}

void elf_release(const struct elf_file *f, const void *p, size_t n)
{
    uintptr_t lo = (uintptr_t)f->data, hi = lo + f->size;
    uintptr_t a = (uintptr_t)p, b = a + n;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    if (!f->data || page == 0 || b < a)
        return;
    if (a < lo)
        a = lo;
    if (b > hi)
        b = hi;
    a = (a + page - 1) & ~(page - 1);
    b &= ~(page - 1);
    if (b > a)
        madvise((void *)a, b - a, MADV_DONTNEED);
}
