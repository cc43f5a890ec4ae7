"""A `kernels` package of another distribution that shadows ours (Hugging Face's, which transformers
>= 5.25 installs) stops `slipstream` at once with an error that names both, not deep in an import."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _slipstream(tmp_path: Path, *pythonpath: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    return subprocess.run([sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())",
                           "generate", "--prompt", "hi"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_shadowing_kernels_package_is_named_and_the_cli_exits_2(tmp_path):
    shadow = tmp_path / "site"
    (shadow / "kernels").mkdir(parents=True)
    (shadow / "kernels" / "__init__.py").write_text("__version__ = '0.19.1'\n")
    done = _slipstream(tmp_path, shadow, REPO)
    assert done.returncode == 2, done.stderr
    assert str(shadow / "kernels") in done.stderr and str(REPO / "kernels") in done.stderr
    assert "pip uninstall kernels" in done.stderr


def test_our_kernels_package_passes_the_check():
    from server.cli import check_kernels_package

    assert check_kernels_package() is None
