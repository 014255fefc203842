/* What the AMX kernels share: the tile configuration's layout and the Linux permission request.
 * Included by gguf_matmul.c (int8 tiles) and bf16_matmul.c (bf16 tiles). */
#ifndef DEEPINFER_AMX_H
#define DEEPINFER_AMX_H
#include <stdint.h>

/* LDTILECFG's 64-byte operand (palette 1: 8 tiles of at most 16 rows x 64 bytes). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Whether this process may use a kernel's tiles, worked out once and kept in *state (0 until
 * then): 1 yes, -1 the OS refused them (`permitted`), -2 they failed the kernel's `self_check`.
 * Threads that ask at once may each work it out; they get the same answer. */
static inline int amx_status_once(int *state, int (*permitted)(void), int (*self_check)(void)) {
    int answer = __atomic_load_n(state, __ATOMIC_ACQUIRE);
    if (answer == 0) {
        answer = !permitted() ? -1 : self_check() ? 1 : -2;
        __atomic_store_n(state, answer, __ATOMIC_RELEASE);
    }
    return answer;
}

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
/* Linux hands out the tile registers' state (XTILEDATA, 8 KB per thread) only to a process that
 * asks (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+); a VM or kernel may refuse. Process-wide,
 * so asking again is harmless. */
static inline int amx_request_permission(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}
#endif
#endif
