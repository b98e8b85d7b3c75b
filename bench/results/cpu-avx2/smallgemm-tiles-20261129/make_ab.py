"""Builds the A/B library: this commit's smallgemm.c with the previous AVX2 path for more than 8 rows (chunks of up
to 8 rows of x against one weight row at a time) behind `redrafter_ab_old(int)`, and the tiles below 9 rows behind
`redrafter_ab_tiles_from(rows, most weight elements)` (default 9: none). engine_ab.py ran without the second switch
(the same path at its default), rows_ab.py with it. Usage: python make_ab.py OUT.so"""

import subprocess
import sys
from pathlib import Path

src = (Path(__file__).parents[4] / "mlx_redrafter/system/csrc/smallgemm.c").read_text()
old_path = """  if (ab_old) {
    int chunks = (M + 7) / 8, small = M / chunks, big = M % chunks;
    for (int nb = n0; nb < n1; nb += BLOCK_N) {
        int ne = nb + BLOCK_N < n1 ? nb + BLOCK_N : n1;
        for (int c = 0, m = 0; c < chunks; c++) {
            int mm = small + (c < big);
            avx2_kernels[mm](x + (size_t)m * K, w, y + (size_t)m * ldy, K, ldy, nb, ne);
            m += mm;
        }
    }
    return;
  }
"""
marker = "    /* More rows: each tile of 4 weight rows"
assert marker in src
src = src.replace(marker, old_path + marker, 1)
small = """    if (M <= 8) {
        avx2_kernels[M](x, w, y, K, ldy, n0, n1);"""
assert small in src
src = src.replace(small, """    if (M <= 8 && !(M >= ab_tiles_from && (long)(n1 - n0) * K <= ab_tiles_max_nk)) {
        avx2_kernels[M](x, w, y, K, ldy, n0, n1);""")
src = src.replace("static int avx512_off = 0;", "static int ab_tiles_from = 9; static long ab_tiles_max_nk = 4000000;\n"
                  "void redrafter_ab_tiles_from(int m, long nk) { ab_tiles_from = m; ab_tiles_max_nk = nk; }\n"
                  "static int avx512_off = 0;")
src = src.replace("static int avx512_off = 0;",
                  "static int ab_old = 0;\nvoid redrafter_ab_old(int on) { ab_old = on; }\nstatic int avx512_off = 0;")
Path(sys.argv[1] + ".c").write_text(src)
subprocess.run(["gcc", "-O3", "-fopenmp", "-shared", "-fPIC", "-o", sys.argv[1], sys.argv[1] + ".c", "-ldl"], check=True)
