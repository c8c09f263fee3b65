"""``pip install splitserve`` without the ``bench`` extra: the server's modules and the CLI work
with matplotlib and ``splitserve.bench`` unimportable, and ``splitserve bench`` says how to get
them. Each check runs in a fresh interpreter whose imports of those are refused."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import splitserve

ROOT = Path(splitserve.__file__).resolve().parents[1]

# Refuses what the bench extra brings, as an install without it would; then runs the check.
_BLOCK = textwrap.dedent("""
    class NoBenchExtra:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "matplotlib" or name == "splitserve.bench" or name.startswith("splitserve.bench."):
                raise ImportError(f"{name} is not installed")
            return None

    sys.meta_path.insert(0, NoBenchExtra())
""")

_BENCH_LOADED = 'sorted(m for m in sys.modules if m.split(".")[0] == "matplotlib" or m.startswith("splitserve.bench"))'


def _python(code: str, block: bool = True) -> subprocess.CompletedProcess[str]:
    prelude = "import sys\n" + (_BLOCK if block else "")
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def _cli(*argv: str, block: bool = True) -> subprocess.CompletedProcess[str]:
    """``splitserve ARGV``; prints the bench modules loaded by the end on its last line."""
    return _python(f"""
        import atexit
        atexit.register(lambda: print({_BENCH_LOADED}))
        sys.argv = ["splitserve", *{list(argv)!r}]
        from splitserve.cli import main
        main()
    """, block)


def test_every_server_module_imports_without_the_bench_extra() -> None:
    r = _python(f"""
        import importlib
        from pathlib import Path
        import splitserve

        pkg = Path(splitserve.__file__).parent
        for f in sorted(pkg.rglob("*.py")):
            parts = f.relative_to(pkg.parent).with_suffix("").parts
            if "bench" in parts or parts[-1] == "__main__":  # __main__ modules run on import
                continue
            importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        print({_BENCH_LOADED})
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_cli_runs_without_the_bench_extra() -> None:
    for argv in (["--help"], ["serve", "--help"], ["models", "--help"], ["plan", "--help"]):
        r = _cli(*argv)
        assert r.returncode == 0, (argv, r.stderr)
        assert r.stdout.splitlines()[-1] == "[]", argv
    assert "bench" in _cli("--help").stdout


def test_splitserve_bench_without_the_extra_names_the_install_command() -> None:
    for argv in (["bench"], ["bench", "rpc-tax", "--quick"], ["bench", "--help"]):
        r = _cli(*argv)
        assert r.returncode == 1, (argv, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "pip install 'splitserve[bench]'" in lines[0], (argv, r.stderr)


def test_the_server_does_not_import_the_benchmarks_even_when_installed() -> None:
    r = _cli("serve", "--help", block=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "[]"
