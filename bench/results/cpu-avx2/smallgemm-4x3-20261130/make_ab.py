"""Builds the A/B library: the committed smallgemm.c plus tiles of 4 rows of x times 3 weight rows (12 accumulators,
3 weight vectors and one row of x: the 16 AVX2 registers, where the committed 3 x 4 tiles need 17 and gcc keeps one
accumulator on the stack) behind `redrafter_ab_43(int)`. Usage: python make_ab.py OUT.so"""

import subprocess
import sys
from pathlib import Path

src = (Path(__file__).parents[4] / "mlx_redrafter/system/csrc/smallgemm.c").read_text()
tiles = "TILE2(3, 4) TILE2(2, 4) TILE2(3, 1) TILE2(2, 1)"
assert tiles in src
src = src.replace(tiles, tiles + " TILE2(4, 3) TILE2(3, 3) TILE2(4, 1)")
marker = "    /* More rows: each tile of 4 weight rows"
assert marker in src
new_path = """    if (ab_43) {
        int chunks = (M + 3) / 4, small = M / chunks, big = M % chunks, pf = K <= 1024;
        int n = n0;
        for (; n + 3 <= n1; n += 3)
            for (int c = 0, m = 0; c < chunks; m += small + (c < big), c++) {
                int ahead = pf && c == 0 && n + 6 <= n1;
                if (small + (c < big) == 4) t_4_3(x + (size_t)m * K, w, y + (size_t)m * ldy, K, ldy, n, ahead);
                else t_3_3(x + (size_t)m * K, w, y + (size_t)m * ldy, K, ldy, n, ahead);
            }
        for (; n < n1; n++)
            for (int c = 0, m = 0; c < chunks; m += small + (c < big), c++) {
                if (small + (c < big) == 4) t_4_1(x + (size_t)m * K, w, y + (size_t)m * ldy, K, ldy, n, 0);
                else t_3_1(x + (size_t)m * K, w, y + (size_t)m * ldy, K, ldy, n, 0);
            }
        return;
    }
"""
src = src.replace(marker, new_path + marker, 1)
src = src.replace("static int avx512_off = 0;",
                  "static int ab_43 = 0;\nvoid redrafter_ab_43(int on) { ab_43 = on; }\nstatic int avx512_off = 0;")
Path(sys.argv[1] + ".c").write_text(src)
subprocess.run(["gcc", "-O3", "-fopenmp", "-shared", "-fPIC", "-o", sys.argv[1], sys.argv[1] + ".c", "-ldl"], check=True)
