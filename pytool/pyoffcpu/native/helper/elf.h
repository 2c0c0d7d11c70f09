/* The ELF file a helper command reads: mapped read-only from a descriptor
 * the caller opened (the helper never opens a path of a target's), every
 * offset and size checked against the mapping before it is used.
 *
 * Only what the helpers need: ELF64 little-endian, the section table, a
 * section by name, a section's bytes. */
#ifndef PYOFFCPU_HELPER_ELF_H
#define PYOFFCPU_HELPER_ELF_H

#include <elf.h>
#include <stddef.h>
#include <stdint.h>

struct elf_file {
    const unsigned char *data;  /* the whole file, mapped */
    size_t size;
    const Elf64_Ehdr *eh;
    const Elf64_Shdr *sh;       /* the section table (shnum entries), or 0 */
    unsigned shnum;
    const char *shstr;          /* section names */
    size_t shstr_size;
    void *sh_copy;              /* sh where the table in the file is not aligned (freed by elf_close) */
};

/* Map the ELF file open at fd; 0 on success, else -1 with why in err. */
int elf_open_fd(struct elf_file *f, int fd, char *err, size_t errlen);
void elf_close(struct elf_file *f);

/* The name of section i ("" when out of bounds). */
const char *elf_section_name(const struct elf_file *f, unsigned i);
/* The first section called name, or 0. */
const Elf64_Shdr *elf_section(const struct elf_file *f, const char *name);
/* The bytes of a section inside the file: 0 with *p, *n set; -1 when it
 * has none in the file (SHT_NOBITS, compressed) or lies outside it. */
int elf_section_data(const struct elf_file *f, const Elf64_Shdr *s,
                     const unsigned char **p, size_t *n);
/* Give the whole pages of [p, p + n) (inside the mapping) back to the
 * kernel: they are read from the file again if touched.  For a large file
 * read once from start to end, so that it is not all resident at once. */
void elf_release(const struct elf_file *f, const void *p, size_t n);

#endif
