"""Find, build (just in time), check and load the compiled extensions of ``amp_fused_ops``.

One job per module; :mod:`amp_fused_ops._loader` re-exports the names the rest of the package
uses. Modules here import each other relatively and nothing else of the package, so that
``hatch_build.py`` can load this folder by path to build an extension into a wheel.

- ``settings``: the kinds, environment variables, file names and error type;
- ``flags``: the compiler flags;
- ``toolkit``: the compiler, ninja and the CUDA toolkit, and why a kind cannot be built;
- ``cache``: where builds live (the cache key) and which sources make a kind;
- ``record``: the build record beside each compiled module (size, SHA-256) and its checks;
- ``lock``: the build lock, who holds it, and how long others wait for it;
- ``progress``: the compile-time estimate and the progress lines while compiling;
- ``build``: compiling, importing, and choosing prebuilt / cached / fresh;
- ``api``: what callers use (``get_extension`` and friends) and the per-process memo.
"""
