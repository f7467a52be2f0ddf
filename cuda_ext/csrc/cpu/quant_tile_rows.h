// The definition of quant_tiles.h's run_rows, for the quant_tiles_rows_*.cpp files, each of
// which instantiates it for two row counts (PS_TILE_ROWS); see the NOTE at run_rows.
#pragma once

#include "quant_tiles.h"

namespace paged_serve::cpu::quant {

template <int R>
void run_rows(Type type, const uint8_t* w, int64_t blocks, const ActTile& t, int lane, float* y, int64_t ldy, int n,
              const float* bias) {
  if constexpr (R <= Vec::kMaxRows) Tiles<Vec, R>::run(type, w, blocks, t, lane, y, ldy, n, bias);
}

#define PS_TILE_ROWS(r)                                                                                        \
  template void run_rows<r>(Type type, const uint8_t* w, int64_t blocks, const ActTile& t, int lane, float* y, \
                            int64_t ldy, int n, const float* bias);

}  // namespace paged_serve::cpu::quant
