//! The bf16 GEMM on AMX tiles (Intel's Advanced Matrix Extensions, AMX-TILE and AMX-BF16: Sapphire
//! Rapids and later): `tdpbf16ps` multiplies a 16 x 32 tile of x by a 32 x 16 tile of weights into
//! 16 x 16 f32 sums, 16 times the work of a `vdpbf16ps`. It reads the same 32-row panels as the
//! AVX-512 BF16 kernel (`gemm.rs`: a weight tile's row j is pair j of 16 panel rows, 128 bytes
//! apart), so nothing about how weights are held changes.
//!
//! One arithmetic for every step size: a row's sums are those of its own tile row whatever else the
//! tile holds (or does not: a one-token decode runs a one-row tile), over the same 16-pair steps of
//! k from 0, a tail of k shorter than a step added after by `vdpbf16ps`; a row's values never
//! depend on how many rows its step has (batch invariance). `tdpbf16ps` rounds differently from a
//! chain of `vdpbf16ps` (measured: most sums differ in the last bits), so a process on this family
//! runs it for every step: never the AVX-512 BF16 tiles for some and tiles here for others.

#![allow(unsafe_code)]

/// Whether this CPU has AMX-TILE and AMX-BF16 and Linux granted this process the tile state
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: without it the first tile instruction
/// faults). Asked once, by the kernel family's detection.
pub(super) fn request_tiles() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        // CPUID leaf 7, subleaf 0: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
        #[allow(unused_unsafe)]
        // SAFETY: CPUID exists on every x86-64 CPU.
        let edx = unsafe { std::arch::x86_64::__cpuid_count(7, 0) }.edx;
        if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
            return false;
        }
        const ARCH_REQ_XCOMP_PERM: libc::c_ulong = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_ulong = 18;
        // SAFETY: a plain system call with integer arguments; it fails (non-zero) where the kernel
        // or the hypervisor does not support the tile state.
        unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        false
    }
}

/// Pairs of k one tile step covers (a tile row is 64 bytes: 32 bf16 values).
const STEP_PAIRS: usize = 16;

/// Pairs of k per block of the full-tile pass: the panel's block (256 pairs x 32 rows, 32 KiB)
/// stays in L1 while every 32-row block of x streams past it.
const BLOCK_PAIRS: usize = 256;

// The tile registers and configuration live from one `asm!` block to the next (between
// `configure` and `tilerelease`): nothing in between is compiled to touch them (no AMX intrinsics
// or target features anywhere in this crate, no calls out), and no rayon call runs inside a tile
// kernel, so no other job can take the thread meanwhile. Each task configures and releases its own.

/// The tile configuration `ldtilecfg` loads (palette 1): tiles 0-3 hold sums (`rows` rows of 16
/// f32), 4-5 x (`rows` rows of 32 bf16), 6-7 weights (16 pairs of 16 rows).
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

/// Loads the configuration for blocks of `rows` (1 to 16) rows of x.
///
/// # Safety
/// The CPU has AMX and this process the tile state ([`request_tiles`]).
#[cfg(target_arch = "x86_64")]
unsafe fn configure(rows: usize) {
    debug_assert!((1..=16).contains(&rows));
    let mut c =
        TileConfig { palette: 1, start_row: 0, reserved: [0; 14], bytes_per_row: [0; 16], rows: [0; 16] };
    for tile in 0..8 {
        c.bytes_per_row[tile] = 64;
        c.rows[tile] = if tile < 6 { rows as u8 } else { STEP_PAIRS as u8 };
    }
    std::arch::asm!("ldtilecfg [{}]", in(reg) &c as *const TileConfig, options(nostack, readonly));
}

/// Sums of one block: `blocks` (1 or 2) 16-row groups of x (`rows` rows each, as configured) times
/// one panel's 32 rows, over `pairs` pairs (a multiple of 16) from `x` and `pan` on: `out[r][0..32]`
/// (+)= the sums, the sums read from `out` first unless `first`.
///
/// # Safety
/// [`configure`]d for `rows`; `x` holds the block's rows (`ldx` values apart) of `2 * pairs` values,
/// `pan` the panel's pairs (`64` values each); `out` the block's rows (`ldo` apart) of 32 f32.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    blocks: usize,
    x: *const u16,
    ldx: usize,
    pan: *const u16,
    pairs: usize,
    out: *mut f32,
    ldo: usize,
    first: bool,
) {
    use std::arch::asm;
    let (sx, so, sw) = (ldx * 2, ldo * 4, 128usize);
    // The second group's rows (past the output where there is no second group: never read then).
    let o1 = out.wrapping_add(16 * ldo);
    if first {
        asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
    } else {
        asm!("tileloadd tmm0, [{o} + {s}*1]", "tileloadd tmm1, [{o} + {s}*1 + 64]",
            o = in(reg) out, s = in(reg) so, options(nostack, readonly));
        if blocks == 2 {
            asm!("tileloadd tmm2, [{o} + {s}*1]", "tileloadd tmm3, [{o} + {s}*1 + 64]",
                o = in(reg) o1, s = in(reg) so, options(nostack, readonly));
        }
    }
    let mut j = 0;
    while j < pairs {
        let (xa, wb) = (x.add(2 * j), pan.add(64 * j));
        asm!(
            "tileloadd tmm4, [{x} + {sx}*1]",
            "tileloadd tmm6, [{w} + {sw}*1]",
            "tileloadd tmm7, [{w} + {sw}*1 + 64]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            x = in(reg) xa, sx = in(reg) sx, w = in(reg) wb, sw = in(reg) sw,
            options(nostack, readonly),
        );
        if blocks == 2 {
            asm!(
                "tileloadd tmm5, [{x} + {sx}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                x = in(reg) xa.add(16 * ldx), sx = in(reg) sx,
                options(nostack, readonly),
            );
        }
        j += STEP_PAIRS;
    }
    asm!("tilestored [{o} + {s}*1], tmm0", "tilestored [{o} + {s}*1 + 64], tmm1",
        o = in(reg) out, s = in(reg) so, options(nostack));
    if blocks == 2 {
        asm!("tilestored [{o} + {s}*1], tmm2", "tilestored [{o} + {s}*1 + 64], tmm3",
            o = in(reg) o1, s = in(reg) so, options(nostack));
    }
}

/// `out[t x 32 np]` (rows `ldo` apart) = x (bf16, `t x k`) times panels `p0..p0 + np`: full
/// 16-row groups in blocks of `BLOCK_PAIRS` (the panel's block in L1 across them), then the last
/// `t % 16` rows in one pass over k, then the tail of k (`k % 32` values) by the AVX-512 BF16 tiles.
///
/// # Safety
/// The CPU has AMX, AVX-512F and AVX-512 BF16 and this process the tile state; the lengths as
/// `gemm_bf16_par` asserts them; `out` has t rows, `ldo` apart, of `np * 32` writable values.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_bf16_amx(
    xb: &[u16],
    t: usize,
    k: usize,
    panels: &[u16],
    p0: usize,
    np: usize,
    out: *mut f32,
    ldo: usize,
) {
    let main_pairs = k / 2 / STEP_PAIRS * STEP_PAIRS;
    let full = t / 16 * 16;
    let x = xb.as_ptr();
    let panel = |p: usize| panels.as_ptr().add((p0 + p) * 32 * k);
    if main_pairs > 0 && full > 0 {
        configure(16);
        for p in 0..np {
            let mut j0 = 0;
            while j0 < main_pairs {
                let pairs = BLOCK_PAIRS.min(main_pairs - j0);
                let mut r = 0;
                while r < full {
                    let blocks = if r + 32 <= full { 2 } else { 1 };
                    let o = out.add(r * ldo + p * 32);
                    block(blocks, x.add(r * k + 2 * j0), k, panel(p).add(64 * j0), pairs, o, ldo, j0 == 0);
                    r += 16 * blocks;
                }
                j0 += pairs;
            }
        }
    }
    if main_pairs > 0 && full < t {
        configure(t - full);
        for p in 0..np {
            block(1, x.add(full * k), k, panel(p), main_pairs, out.add(full * ldo + p * 32), ldo, true);
        }
    }
    if main_pairs > 0 {
        std::arch::asm!("tilerelease", options(nostack, nomem));
    }
    let tail = k / 2 - main_pairs;
    if tail > 0 {
        for p in 0..np {
            super::gemm::tail_bf16(xb, t, k, 2 * main_pairs, panel(p), out.add(p * 32), ldo);
        }
    }
}

/// Runs `iters` rounds of four independent `tdpbf16ps` (16 x 32 by 32 x 16 tiles into four 16 x 16
/// sums, from tiles zeroed once: no memory traffic); the floating-point operations done, or `None`
/// where the CPU has no AMX or Linux does not grant the tile state. `cargo xtask bench peak`'s tile
/// column.
pub fn tile_peak(iters: u64) -> Option<u64> {
    if !request_tiles() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has AMX and this process the tile state (checked just above).
    unsafe {
        use std::arch::asm;
        configure(16);
        asm!("tilezero tmm4", "tilezero tmm5", "tilezero tmm6", "tilezero tmm7", options(nostack, nomem));
        asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
        for _ in 0..iters {
            asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                options(nostack, nomem),
            );
        }
        asm!("tilerelease", options(nostack, nomem));
    }
    Some(iters * 4 * (16 * 16 * 32 * 2))
}
