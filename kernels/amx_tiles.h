// The AMX tile configuration both bf16 tile kernels use (amx_gemm.cpp, amx_swap.cpp): all 8 tiles
// 16 rows x 64 bytes (0-3 fp32 accumulators, 4-7 bf16 operands). Include only where <immintrin.h>
// and the AMX target attribute are available (x86-64 GCC).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace ascend_kernels {

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile"))) inline void configure_amx_tiles() {
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC 12 drops the stores to cfg without this (seen: SIGILL)
  _tile_loadconfig(&cfg);
}

}  // namespace ascend_kernels
