/* Work sharing with row affinity for the OpenMP kernels: tasks in one contiguous range per thread,
 * each thread taking its own range's tasks in order first, then stealing what is left of the
 * others' (the next task of a range is an atomic counter: each task runs exactly once).
 *
 * Why not schedule(dynamic): the ranges are ATen's split of rows among threads (at::parallel_for:
 * thread k gets rows k * ceil(N / T) onwards), which LayerNorm and the other row-wise ops of a
 * layer use too. A row then stays on one core from op to op while the threads keep pace, instead
 * of being read from the other core's cache; stealing keeps dynamic scheduling's balance when one
 * thread falls behind (a busy neighbour). Which thread runs a task never changes its bits. */
#ifndef BERT_PORT_TASKS_H
#define BERT_PORT_TASKS_H

#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
#endif

struct task_range {
  int64_t next, end;       /* tasks next..end-1 of this range are left (next may overshoot end) */
  int64_t first, rows;     /* the range's first item (row block, sequence) and its count */
} __attribute__((aligned(64))); /* one cache line per range: two threads' counters never share one */

/* The next task for thread `tid` of `threads` ranges: from its own range, then from the others in
 * turn; -1 when none is left. `*range` is the range the task came from (task counts within it);
 * `*cursor` (0 at the start) how far the thread has moved on from its own range. */
static inline int64_t next_task(struct task_range *ranges, int threads, int tid, int *cursor, int *range) {
  for (; *cursor < threads; ++*cursor) {
    *range = (tid + *cursor) % threads;
    const int64_t task = __atomic_fetch_add(&ranges[*range].next, 1, __ATOMIC_RELAXED);
    if (task < ranges[*range].end) return task;
  }
  return -1;
}

/* ATen's split of n rows among `threads`: thread k's rows start at k * ceil(n / threads). */
static inline int64_t split_start(int64_t n, int threads, int k) {
  const int64_t chunk = (n + threads - 1) / threads;
  return k * chunk < n ? k * chunk : n;
}

#endif
