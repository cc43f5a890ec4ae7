"""PEFT adapters read and checked against the base model: scale (alpha / r, rslora), and a clear error
naming the file and the field or tensor for each way an adapter can be wrong; paths stay under the root."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("peft")

from safetensors.numpy import load_file, save_file  # noqa: E402

from slipstream.engine.lora_registry import LoraRegistry  # noqa: E402
from slipstream.models.lora import LoraError, load_adapter, lora_targets, resolve_under  # noqa: E402
from tests.engine.lora_helpers import make_adapter  # noqa: E402

KEY = "base_model.model.model.layers.1.self_attn.q_proj.lora_{}.weight"


@pytest.fixture(scope="module")
def setup(tiny_llama_dir, tiny_model, tmp_path_factory):
    cfg, model = tiny_model
    root = str(tmp_path_factory.mktemp("lora-root"))
    make_adapter(tiny_llama_dir, os.path.join(root, "good"), 4, 8, ["q_proj", "v_proj", "down_proj"])
    make_adapter(tiny_llama_dir, os.path.join(root, "rs"), 4, 8, ["o_proj"], rslora=True)
    targets = lora_targets(model)
    return root, targets, cfg.num_layers


def _load(setup, name, max_rank=64):
    root, targets, layers = setup
    return load_adapter(name, os.path.join(root, name), targets, layers, max_rank)


def _variant(setup, name, edit_config=None, edit_tensors=None):
    root = setup[0]
    src, dst = os.path.join(root, "good"), os.path.join(root, name)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    if edit_config:
        path = os.path.join(dst, "adapter_config.json")
        cfg = json.load(open(path))
        edit_config(cfg)
        json.dump(cfg, open(path, "w"))
    if edit_tensors:
        path = os.path.join(dst, "adapter_model.safetensors")
        tensors = load_file(path)
        edit_tensors(tensors)
        save_file(tensors, path)
    return name


def test_good_adapter_scales_b_and_lists_its_modules(setup):
    good = _load(setup, "good")
    assert good.modules == ("q_proj", "v_proj", "down_proj") and good.rank == 4 and good.scale == 2.0
    raw = load_file(os.path.join(setup[0], "good", "adapter_model.safetensors"))
    a, b = good.weights["q_proj"]
    np.testing.assert_array_equal(a[1], raw[KEY.format("A")].T)
    np.testing.assert_allclose(b[1], raw[KEY.format("B")].T * 2.0)
    assert _load(setup, "rs").scale == pytest.approx(8 / 2.0)  # rslora: alpha / sqrt(r)


@pytest.mark.parametrize("case, edit_config, edit_tensors, message", [
    ("rank", lambda c: c.update(r=128), None, "r must be an integer in [1, 64]"),
    ("dora", lambda c: c.update(use_dora=True), None, "use_dora"),
    ("module", lambda c: c.update(target_modules=["q_proj", "lm_head"]), None, "target_modules names ['lm_head']"),
    ("shape", None, lambda t: t.update({KEY.format("A"): np.zeros((4, 65), np.float32)}),
     f"tensor {KEY.format('A')} has shape [4, 65], the base model needs [4, 64]"),
    ("extra", None, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": np.zeros((4, 64), np.float32)}),
     "tensor base_model.model.lm_head.lora_A.weight is not a lora_A/lora_B weight of a supported module"),
    ("missing", None, lambda t: t.pop(KEY.format("B")), f"tensor {KEY.format('B')} is missing"),
    ("nan", None, lambda t: t[KEY.format("B")].__setitem__((0, 0), np.nan), "NaN"),
])
def test_bad_adapters_name_the_file_and_what_is_wrong(setup, case, edit_config, edit_tensors, message):
    name = _variant(setup, f"bad-{case}", edit_config, edit_tensors)
    with pytest.raises(LoraError) as err:
        _load(setup, name)
    assert message in str(err.value)
    assert os.path.join(setup[0], name) in str(err.value)  # the file


def test_missing_files_are_named(setup):
    root = setup[0]
    name = _variant(setup, "no-weights")
    os.remove(os.path.join(root, name, "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="adapter_model.safetensors: missing"):
        _load(setup, name)
    os.remove(os.path.join(root, name, "adapter_config.json"))
    with pytest.raises(LoraError, match="adapter_config.json: missing"):
        _load(setup, name)


def test_paths_outside_the_root_are_refused(setup, tmp_path):
    root = setup[0]
    outside = tmp_path / "outside"
    shutil.copytree(os.path.join(root, "good"), outside)
    os.symlink(outside, os.path.join(root, "link-out"))
    for path in ("../outside", str(outside), "link-out", "good/../../outside", ".", ""):
        with pytest.raises(LoraError, match="outside --lora-root"):
            resolve_under(root, path)
    assert resolve_under(root, "good") == os.path.realpath(os.path.join(root, "good"))
    with pytest.raises(LoraError, match="no --lora-root"):
        resolve_under("", "good")


def test_registry_changes_nothing_on_a_bad_load(setup):
    root, targets, layers = setup
    registry = LoraRegistry(lambda name, path: load_adapter(name, path, targets, layers, 64), root)
    registry.load("good", "good")
    with pytest.raises(LoraError):
        registry.load("good", "rs")           # the name is taken
    with pytest.raises(LoraError):
        registry.load("other", "../x")        # outside the root
    with pytest.raises(LoraError):
        registry.load("base", "rs", reserved=frozenset({"base"}))
    assert registry.names() == ["good"]
    registry.unload("good")
    assert registry.names() == []
