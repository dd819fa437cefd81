/* The schedule's sender choice, for every write of a plan in one call (reference/plan/assign.py).

   Hand-written C rather than a library: this is the planner's core loop (the project's own
   scheduling policy, reference.plan.schedule._least_loaded), about two million writes at
   Kimi-K2 scale, and no library offers "least-loaded argmin with this tie-break, then update the
   loads". Compiled on first use and loaded with ctypes like reference/_fp8_cpu.c.

   Items are (recipe, receiving rank) pairs; each task's items are contiguous, in order of its
   recipes. Per task:
     1. items sorted by (output bytes descending, recipe ascending, receiver ascending);
     2. in that order each item goes to the candidate r minimizing (send[r], pair[dst][r], r)
        -- bytes sent so far, bytes sent to this receiver, rank -- and the loads grow by the
        recipe's bytes (send, pair, recv);
     3. the task's items are written to `order` sorted by (sender, recipe, position in 1.),
        the order in which the plan groups them into tasks and assignments.
   All byte counts int64; ranks int32. Returns 0, or -1 when out of memory. */
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    int64_t nb;
    int32_t rec, dst, item, sender, pos;
} item_t;

static int by_size(const void *a, const void *b) {
    const item_t *x = a, *y = b;
    if (x->nb != y->nb) return x->nb > y->nb ? -1 : 1;
    if (x->rec != y->rec) return x->rec < y->rec ? -1 : 1;
    return (x->dst > y->dst) - (x->dst < y->dst);
}

static int by_sender(const void *a, const void *b) {
    const item_t *x = a, *y = b;
    if (x->sender != y->sender) return x->sender < y->sender ? -1 : 1;
    if (x->rec != y->rec) return x->rec < y->rec ? -1 : 1;
    return (x->pos > y->pos) - (x->pos < y->pos);
}

int64_t plan_greedy(int64_t n_tasks, const int64_t *task_start, const int32_t *item_rec, const int32_t *item_dst,
                    const int64_t *rec_nb, const int64_t *rec_cand, const int32_t *rec_ncand, const int32_t *cands,
                    const int32_t *dst_slot, int64_t n_slots, int64_t *send, int64_t *pair, int64_t *recv,
                    int64_t *order, int32_t *sender) {
    int64_t most = 0;
    for (int64_t t = 0; t < n_tasks; t++)
        if (task_start[t + 1] - task_start[t] > most) most = task_start[t + 1] - task_start[t];
    item_t *buf = malloc((size_t)(most > 0 ? most : 1) * sizeof(item_t));
    if (!buf) return -1;
    for (int64_t t = 0; t < n_tasks; t++) {
        int64_t s = task_start[t], n = task_start[t + 1] - s;
        for (int64_t k = 0; k < n; k++) {
            int32_t it = (int32_t)(s + k), rec = item_rec[s + k];
            buf[k] = (item_t){rec_nb[rec], rec, item_dst[s + k], it, -1, 0};
        }
        qsort(buf, (size_t)n, sizeof(item_t), by_size);
        for (int64_t k = 0; k < n; k++) {
            item_t *x = &buf[k];
            const int32_t *c = cands + rec_cand[x->rec];
            int32_t nc = rec_ncand[x->rec], dslot = dst_slot[x->dst];
            int64_t *pl = pair + (int64_t)dslot * n_slots;
            int32_t best = c[0];
            for (int32_t j = 1; j < nc; j++) {
                int32_t r = c[j];
                if (send[r] < send[best] ||
                    (send[r] == send[best] && (pl[r] < pl[best] || (pl[r] == pl[best] && r < best))))
                    best = r;
            }
            send[best] += x->nb;
            pl[best] += x->nb;
            recv[dslot] += x->nb;
            x->sender = best;
            x->pos = (int32_t)k;
        }
        qsort(buf, (size_t)n, sizeof(item_t), by_sender);
        for (int64_t k = 0; k < n; k++) {
            order[s + k] = buf[k].item;
            sender[buf[k].item] = buf[k].sender;
        }
    }
    free(buf);
    return 0;
}
