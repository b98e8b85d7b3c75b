import sys, os, subprocess, sysconfig
import mlx, nanobind
mlx_dir = list(mlx.__path__)[0]; nb_dir = os.path.dirname(nanobind.__file__)
def build(src, name, extra=()):
    out = f"/tmp/pkb/{name}" + sysconfig.get_config_var("EXT_SUFFIX")
    cmd = ["g++", "-O3", "-std=c++20", "-fPIC", "-shared", "-fvisibility=hidden", "-fopenmp", "-Wno-psabi", "-DNDEBUG",
           "-DNB_COMPACT_ASSERTIONS", "-DNB_DOMAIN=mlx", "-I" + sysconfig.get_paths()["include"],
           "-I" + os.path.join(nb_dir, "include"), "-I" + os.path.join(nb_dir, "ext", "robin_map", "include"),
           "-I" + os.path.join(mlx_dir, "include"), src, os.path.join(nb_dir, "src", "nb_combined.cpp"),
           "-L" + os.path.join(mlx_dir, "lib"), "-lmlx", "-Wl,-rpath," + os.path.join(mlx_dir, "lib"), "-o", out, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True); print(name, r.returncode, r.stderr[-500:])
for a in sys.argv[1:]:
    src, name, *extra = a.split(":")
    build(src, name, extra)
