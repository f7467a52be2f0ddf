// quant_tiles.h's micro-kernels for tiles of 4 and 8 rows (quant_tile_rows.h).
#include "quant_tile_rows.h"

namespace paged_serve::cpu::quant {

PS_TILE_ROWS(4)
PS_TILE_ROWS(8)

}  // namespace paged_serve::cpu::quant
