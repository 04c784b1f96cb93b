/* The C library's heap, for bert-port-embed's own process (bert_port/embed/run.py): give its free
 * pages back after a batch (malloc_trim), and serve blocks of `threshold` bytes or more from
 * mappings of their own (mallopt M_MMAP_THRESHOLD). glibc only; elsewhere both do nothing and
 * return 0. Built with the kernels at install, so nothing is loaded from libc at run time. */
#include <stddef.h>
#include <stdlib.h> /* defines __GLIBC__ where the C library is glibc */
#ifdef __GLIBC__
#include <malloc.h>
#endif

int heap_trim(void) {
#ifdef __GLIBC__
  return malloc_trim(0);
#else
  return 0;
#endif
}

int heap_map_above(size_t threshold) {
#ifdef __GLIBC__
  return mallopt(M_MMAP_THRESHOLD, (int)threshold);
#else
  (void)threshold;
  return 0;
#endif
}
