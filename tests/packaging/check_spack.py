#!/usr/bin/env python3
"""Checks packaging/spack/package.py without Spack (not installable offline): loads it against a
stand-in `spack.package` that records its directives, then checks that it is a CMakePackage
and CudaPackage, declares the variants mpi and torch (+cuda from CudaPackage), and that
cmake_args() passes LOCKSTEP_ENABLE_<PART> for each variant and only options the source
tree's CMake reads.

    check_spack.py <lockstep source>
"""
import importlib.util
import pathlib
import re
import sys
import types

src = pathlib.Path(sys.argv[1])
recorded = {"variant": [], "depends_on": [], "version": [], "conflicts": []}


def directive(name):
    def record(*args, **kwargs):
        recorded[name].append((args, kwargs))
    return record


class CMakePackage:
    def define(self, name, value):
        return f"-D{name}:BOOL={'ON' if value else 'OFF'}" if isinstance(value, bool) else f"-D{name}={value}"

    def define_from_variant(self, name, variant):
        return self.define(name, variant in self.enabled)


class CudaPackage:
    pass


spack = types.ModuleType("spack")
package = types.ModuleType("spack.package")
package.CMakePackage, package.CudaPackage = CMakePackage, CudaPackage
for name in recorded:
    setattr(package, name, directive(name))
package.__all__ = ["CMakePackage", "CudaPackage", *recorded]
sys.modules["spack"], sys.modules["spack.package"] = spack, package

spec = importlib.util.spec_from_file_location("lockstep_spack", src / "packaging" / "spack" / "package.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)

failures = []
cls = getattr(module, "Lockstep", None)
if cls is None:
    sys.exit("packaging/spack/package.py defines no class Lockstep")
for base in (CMakePackage, CudaPackage):
    if not issubclass(cls, base):
        failures.append(f"Lockstep is not a {base.__name__}")
variants = {args[0] for args, _ in recorded["variant"]} | {"cuda"}  # cuda: CudaPackage's
if variants != {"cuda", "mpi", "torch"}:
    failures.append(f"variants are {sorted(variants)}, expected cuda, mpi, torch")
if not recorded["version"]:
    failures.append("no version() directive")

cmake_text = "".join(p.read_text() for p in [src / "CMakeLists.txt", *(src / "cmake").glob("*.cmake")])
known = set(re.findall(r"lockstep_part_mode\((\w+)", cmake_text))
known = {f"LOCKSTEP_ENABLE_{p}" for p in known} | set(re.findall(r"option\((LOCKSTEP_\w+)", cmake_text))
for on in ({"cuda"}, {"mpi"}, {"torch"}, set()):
    pkg = cls.__new__(cls)
    pkg.enabled = on
    args = pkg.cmake_args()
    defined = dict(re.match(r"-D(\w+)(?::\w+)?=(.*)", a).groups() for a in args)
    for name in defined:
        if name not in known:
            failures.append(f"cmake_args() passes {name}, which lockstep's CMake does not read")
    for part in ("cuda", "mpi", "torch"):
        want = "ON" if part in on else "OFF"
        got = defined.get(f"LOCKSTEP_ENABLE_{part.upper()}")
        if got != want:
            which = sorted(on) or "no variant"
            failures.append(f"with {which}: LOCKSTEP_ENABLE_{part.upper()} is {got}, expected {want}")

if failures:
    print("check_spack: " + "\ncheck_spack: ".join(failures))
    sys.exit(1)
print(f"check_spack: ok: variants {sorted(variants)}; options {sorted(defined)}")
