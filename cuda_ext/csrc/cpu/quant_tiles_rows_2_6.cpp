// quant_tiles.h's micro-kernels for tiles of 2 and 6 rows (quant_tile_rows.h).
#include "quant_tile_rows.h"

namespace paged_serve::cpu::quant {

PS_TILE_ROWS(2)
PS_TILE_ROWS(6)

}  // namespace paged_serve::cpu::quant
