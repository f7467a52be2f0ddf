// quant_tiles.h's micro-kernels for tiles of 1 and 5 rows (quant_tile_rows.h).
#include "quant_tile_rows.h"

namespace paged_serve::cpu::quant {

PS_TILE_ROWS(1)
PS_TILE_ROWS(5)

}  // namespace paged_serve::cpu::quant
