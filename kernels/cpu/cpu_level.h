/* Kernels compiled once per x86-64 level, for builds that run on any x86-64 CPU.
 *
 * A build without -march=native (RLFLOW_NATIVE=OFF, or a build type other than Release: the
 * GPU machine's pack and the sanitizer builds) compiles for the x86-64 baseline: SSE2,
 * no FMA, so that every fmaf is a call into libm's software routine. The kernels whose speed
 * hangs on the instruction set are then compiled twice more (CMakeLists.txt, RF_CPU_LEVELS),
 * for x86-64-v3 (AVX2, FMA) and x86-64-v4 (AVX-512), and each entry point calls the copy of
 * the highest level the CPU has (cpu_level.c), as PyTorch's CPU_CAPABILITY copies of its
 * kernels do. A build with -march=native has one copy, for the CPU it was built on.
 *
 * In a file compiled per level, an entry point is defined under RF_LEVELED(name): name itself
 * in a build of one copy; name_v3 / name_v4 in the level copies (RF_CPU_LEVEL is v3 or v4
 * there); name_base in the baseline copy of a build with levels, where cpu_level.c defines
 * name as the call to the right copy. Code that a level copy does not need is left out of it
 * under #ifndef RF_CPU_LEVEL. Each copy is the same C, so a level gives the bits a
 * -march=native build gives on a CPU of that level wherever the compiler makes the same
 * choices (contraction to fused multiply-adds, vector width for the sums whose order it
 * splits; attention's forward: the same bits at v3, v4 and -march=native on an Ice Lake Xeon).
 * test_kernels runs these kernels' checks on every level the CPU has. */
#ifndef RF_CPU_LEVEL_H
#define RF_CPU_LEVEL_H

#define RF_LEVEL_CAT_(a, b) a##_##b
#define RF_LEVEL_CAT(a, b) RF_LEVEL_CAT_(a, b)
#if defined(RF_CPU_LEVEL)
#define RF_LEVELED(name) RF_LEVEL_CAT(name, RF_CPU_LEVEL)
#elif defined(RF_CPU_LEVELS)
#define RF_LEVELED(name) name##_base
#else
#define RF_LEVELED(name) name
#endif

/* The levels (rf_cpu_level): 0 the build's one copy (-march=native, or not x86-64); 1 the
 * x86-64 baseline; 3 x86-64-v3; 4 x86-64-v4. */
enum { RF_CPU_LEVEL_BUILD = 0, RF_CPU_LEVEL_BASE = 1, RF_CPU_LEVEL_V3 = 3, RF_CPU_LEVEL_V4 = 4 };

/* The level whose copies run: the highest this CPU has, or the one rf_cpu_level_use set. */
int rf_cpu_level(void);
/* Whether copies of `level` exist in this build and can run on this CPU. */
int rf_cpu_level_available(int level);
/* Runs the copies of `level` from now on (an available one; tests); returns the level before. */
int rf_cpu_level_use(int level);
/* "native", "x86-64-v4", "x86-64-v3" or "x86-64": the copies that run, for logs and benches. */
const char *rf_cpu_level_name(void);

#endif
