/* Seeded, reproducible random numbers (xoshiro256**, seeded through splitmix64).
 * Used for weight initialisation and sampling; the state is a plain struct so that it can be
 * checkpointed and restored bit for bit. Not thread-safe: one rf_rng per thread or stream. */
#ifndef RF_RNG_H
#define RF_RNG_H

#include <stdint.h>

typedef struct rf_rng {
    uint64_t s[4];
} rf_rng;

void rf_rng_seed(rf_rng *r, uint64_t seed);
uint64_t rf_rng_u64(rf_rng *r);
/* Uniform in [0, 1) with 24 bits of precision (exactly representable as float). */
float rf_rng_uniform(rf_rng *r);
/* Standard normal (Box-Muller). */
float rf_rng_normal(rf_rng *r);

#endif
