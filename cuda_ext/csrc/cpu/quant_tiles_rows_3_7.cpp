// quant_tiles.h's micro-kernels for tiles of 3 and 7 rows (quant_tile_rows.h).
#include "quant_tile_rows.h"

namespace paged_serve::cpu::quant {

PS_TILE_ROWS(3)
PS_TILE_ROWS(7)

}  // namespace paged_serve::cpu::quant
