"""Module records (spec/module-trait.txt: into_record, into_record_group, try_load_record, load_record, save_file,
load_file, try_load_file) and Burn's MNIST burnpack loaded into a kiln model (examples/mnist_burn.py)."""

from __future__ import annotations

import importlib.util
import mmap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln import DTypePolicy, Lora, Module, ModuleRecord, Param, ParamGroup, nn
from kiln.ir import DType, RecordError, interpret
from kiln.ir import init as initializers
from kiln.runtime.records.burnpack import BurnDType, PackTensor
from kiln.runtime.records.burnpack_io import BurnpackFile, write_burnpack

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / ".." / "shared" / "fixtures" / "burn" / "mnist-model.bpk"
AD = kiln.Device("cpu").autodiff()


class Mixed(Module):
    """Lazy float layers, initialized f16/bf16 parameters, int and bool buffers, and two flags."""

    def __init__(self, device: kiln.Device | None = None, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.fc = nn.Linear(3, 2, device=device)
        self.norm = nn.BatchNorm1d(2, device=device)
        self.half = Param.from_data(rng.standard_normal(4).astype(np.float16), device=device)
        self.brain = Param.from_data(rng.standard_normal((2, 2)).astype(ml_dtypes.bfloat16), device=device)
        self.steps = Param.from_data(rng.integers(0, 100, 3), device=device).replace(buffer=True)
        self.mask = Param.from_data(rng.random(5) > 0.5, device=device).replace(buffer=True)
        self.drop = nn.Dropout(0.1)


def params(m: Module) -> dict[str, Param]:
    return {path: leaf for path, leaf in m.leaves() if isinstance(leaf, Param)}


def values(m: Module) -> dict[str, tuple[int, DType, list]]:
    """Every parameter's id, dtype and value (initializing lazy ones)."""
    return {path: (p.id, p.type.dtype, np.asarray(p.state.get()).tolist()) for path, p in params(m).items()}


class ParamMap(kiln.ModuleMapper):
    """A mapper applying `fn(path, param)` to every parameter."""

    def __init__(self, fn):
        self.fn = fn

    def map_param(self, path: str, param: Param) -> Param:
        return self.fn(path, param)


def mmap_backed(array: np.ndarray) -> bool:
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)


def forbid_initializers(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, running any lazy initializer fails the test."""
    monkeypatch.setattr(initializers, "evaluate", lambda *args: pytest.fail("a lazy parameter was initialized"))


# round trips ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["record", "bytes", "file"])
def test_round_trip_keeps_values_ids_and_dtypes(route, tmp_path):
    """"The record can be saved to a burnpack file or byte buffer and applied back with load_record." """
    source, destination = Mixed(seed=1), Mixed(seed=2)
    record = source.into_record()
    if route == "bytes":
        record = ModuleRecord.from_bytes(record.to_bytes())
    elif route == "file":
        source.save_file(tmp_path / "mixed.bpk")
        record = ModuleRecord.load(tmp_path / "mixed.bpk")
    loaded = destination.load_record(record)
    assert values(loaded) == values(source) != values(destination)
    assert {p: v[1] for p, v in values(loaded).items()} == {
        "fc.weight": DType.f32, "fc.bias": DType.f32, "norm.gamma": DType.f32, "norm.beta": DType.f32,
        "norm.running_mean": DType.f32, "norm.running_var": DType.f32, "half": DType.f16, "brain": DType.bf16,
        "steps": DType.i64, "mask": DType.bool}


def test_load_file_and_try_load_file(tmp_path):
    """save_file then load_file / try_load_file with the default load behavior."""
    source = Mixed(seed=1)
    source.save_file(tmp_path / "mixed")  # Burn adds the extension
    assert values(Mixed().load_file(tmp_path / "mixed.bpk")) == values(source)
    assert values(Mixed().try_load_file(tmp_path / "mixed")) == values(source)


def test_the_records_param_id_replaces_the_modules():
    """Loading restores the record's ParamIds (Burn's `load_record_preserves_param_id`)."""
    source, destination = Mixed(), Mixed()
    loaded = destination.load_record(source.into_record())
    assert {p.id for p in params(loaded).values()} == {p.id for p in params(source).values()}
    assert not {p.id for p in params(loaded).values()} & {p.id for p in params(destination).values()}


def test_flags_are_not_recorded_and_keep_the_destinations_state_and_identity():
    """"Module-owned control values such as Flag ... are not recorded; loading preserves their state and identity
    from the destination module." """
    source, destination = Mixed().freeze(), Mixed()
    record = source.into_record()
    assert "drop.training" not in record and "norm.training" not in record
    loaded = destination.load_record(record)
    assert loaded.drop.training is destination.drop.training and loaded.drop.training.value
    assert loaded.norm.training is destination.norm.training


def test_the_destination_keeps_its_gradient_and_device_state():
    source, destination = Mixed(AD).no_grad(), Mixed(AD)
    loaded = destination.load_record(source.into_record())
    state = {path: (p.grad, p.configured_grad, p.device, p.leaf, p.buffer) for path, p in params(loaded).items()}
    assert state == {path: (p.grad, p.configured_grad, p.device, p.leaf, p.buffer)
                     for path, p in params(destination).items()}
    assert state["fc.weight"][:2] == (True, True) and state["steps"][:2] == (False, False)


# problems and settings ----------------------------------------------------------------------------------------
class Small(Module):
    def __init__(self, d_in: int, extra: str):
        self.fc = nn.Linear(d_in, 2)
        setattr(self, extra, Param.from_data(np.ones(1, np.float32)))


def test_shape_mismatch_missing_and_unused_are_reported_together_in_order():
    """Burn's checks in order (apply errors, missing, unused), but every problem in one RecordError."""
    record = Small(4, "extra").into_record()
    destination = Small(3, "scale")
    with pytest.raises(RecordError) as caught:
        destination.try_load_record(record)
    message = str(caught.value)
    apply_error = "fc.weight: shape mismatch, expected [3, 2] but record has [4, 2]"
    assert message.index(apply_error) < message.index("Missing tensors: ['scale']") < message.index(
        "Unused tensors: ['extra']")
    with pytest.raises(RuntimeError, match="^Failed to load record: Apply errors") as panic:
        destination.load_record(record)
    assert isinstance(panic.value.__cause__, RecordError)


def test_tolerant_settings_load_what_fits_and_leave_the_rest_lazy(monkeypatch):
    record = ModuleRecord.from_bytes(Small(4, "extra").into_record().to_bytes())
    destination = Small(3, "scale")
    forbid_initializers(monkeypatch)
    loaded = destination.load_record(record.allow_partial(True).allow_unused(True).validate(False))
    assert loaded.fc.bias.id == record["fc.bias"].param_id and loaded.fc.bias.is_initialized()
    assert loaded.fc.weight is destination.fc.weight and not loaded.fc.weight.is_initialized()
    assert loaded.scale is destination.scale


def test_each_check_can_be_turned_off_alone():
    record = Small(4, "extra").into_record()
    for tolerant, still_reported in [(record.validate(False), "Missing"), (record.allow_partial(True), "Apply"),
                                     (record.allow_unused(True), "Apply")]:
        with pytest.raises(RecordError, match=still_reported):
            Small(3, "scale").try_load_record(tolerant)
    fits = Small(3, "extra").into_record()
    Small(3, "scale").try_load_record(fits.allow_partial(True).allow_unused(True))


def test_dtype_policy_keeps_the_records_dtype_or_casts_to_the_modules():
    source = Small(3, "extra")
    source.fc = source.fc.map(ParamMap(lambda path, p: Param.from_data(np.asarray(p.state.get(), ml_dtypes.bfloat16),
                                                                       id=p.id)))
    record = source.into_record()
    kept = Small(3, "extra").load_record(record)
    assert kept.fc.weight.type.dtype is DType.bf16 and kept.fc.weight.val().dtype is DType.bf16
    cast = Small(3, "extra").load_record(record.with_dtype_policy(DTypePolicy.CAST_TO_MODULE))
    assert cast.fc.weight.type.dtype is DType.f32
    np.testing.assert_array_equal(cast.fc.weight.state.value, np.asarray(record["fc.weight"].array(), np.float32))


def test_failed_loads_raise_and_leave_the_receiver_unchanged(tmp_path):
    destination = Mixed()
    before = {path: (p.id, p.state) for path, p in params(destination).items()}
    with pytest.raises(RecordError, match="cannot open"):
        destination.try_load_file(tmp_path / "absent.bpk")
    with pytest.raises(RuntimeError, match="^Failed to load module from file") as panic:
        destination.load_file(tmp_path / "absent.bpk")
    assert isinstance(panic.value.__cause__, RecordError)
    destination.load_record(Mixed().into_record())
    assert {path: (p.id, p.state) for path, p in params(destination).items()} == before


# groups ---------------------------------------------------------------------------------------------------------
def test_into_record_group_skips_unmatched_parameters_before_reading_them(tmp_path):
    """"A parameter the group does not match is skipped before its data is read" """
    m = Mixed()
    record = m.into_record_group(ParamGroup.from_glob("norm.*"))
    assert list(record) == ["norm.gamma", "norm.beta", "norm.running_mean", "norm.running_var"]
    record.save(tmp_path / "norm.bpk")
    assert not any(p.is_initialized() for path, p in params(m).items() if path.startswith(("fc.", "norm.")))


def test_a_group_record_applies_over_the_checkpoint_it_started_from(tmp_path):
    """What a run that trained a group writes, applied back over its checkpoint with allow_partial."""
    checkpoint = tmp_path / "checkpoint.bpk"
    Mixed(seed=1).save_file(checkpoint)
    start = Mixed().load_file(checkpoint)
    trained = start.map(ParamMap(lambda path, p: Param.from_data(np.asarray(p.state.get()) + 1, id=p.id)
                                 if path.startswith("fc.") else p))
    group_record = trained.into_record_group(ParamGroup.from_glob("fc.*"))
    with pytest.raises(RecordError, match="Missing tensors"):
        Mixed().load_file(checkpoint).try_load_record(group_record)
    restored = Mixed().load_file(checkpoint).load_record(group_record.allow_partial(True))
    assert values(restored) == values(trained)
    assert values(restored)["half"] == values(start)["half"]


# LoRA -----------------------------------------------------------------------------------------------------------
class Adapted(Module):
    def __init__(self):
        self.fc = nn.Linear(4, 6)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return self.drop(self.fc(x))


def test_lora_round_trip_keeps_base_and_factors_under_burns_names():
    """Burn's `lora_record_roundtrip_preserves_base_and_adapter`: paths weight / weight.lora.a / .b."""
    source = Adapted().apply_lora(Lora(rank=2, alpha=4.0))
    source = source.map(ParamMap(lambda path, p: Param.from_data(np.full(p.lazy_shape(), 0.1, np.float32), id=p.id)
                                 if path.endswith("lora.b") else p))
    record = ModuleRecord.from_bytes(source.into_record().to_bytes())
    assert list(record) == ["fc.weight", "fc.weight.lora.a", "fc.weight.lora.b", "fc.bias"]
    base = np.asarray(source.fc.weight.state.get())
    np.testing.assert_array_equal(record["fc.weight"].array(), base)  # the base, not the effective weight
    loaded = Adapted().apply_lora(Lora(rank=2, alpha=4.0)).load_record(record)
    assert values(loaded) == values(source)
    assert [s for s, _ in loaded.fc.weight.reparam.factors] == ["lora.a", "lora.b"]
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    out = loaded.valid()(kiln.tensor(x)).numpy()
    np.testing.assert_array_equal(out, source.valid()(kiln.tensor(x)).numpy())


# laziness -----------------------------------------------------------------------------------------------------
def test_recording_and_saving_a_lazy_module_initializes_nothing(tmp_path):
    m = Mixed()
    record = m.into_record()
    record.save(tmp_path / "lazy.bpk")
    assert not m.fc.weight.is_initialized() and not m.norm.running_var.is_initialized()
    assert callable(record["fc.weight"].data)
    assert values(Mixed().load_file(tmp_path / "lazy.bpk")) == values(m)  # the values it initializes to later


def test_loading_a_file_keeps_data_memory_mapped_and_never_initializes_the_destination(tmp_path, monkeypatch):
    Mixed(seed=1).save_file(tmp_path / "mixed.bpk")
    forbid_initializers(monkeypatch)
    loaded = Mixed().load_file(tmp_path / "mixed.bpk")
    assert all(p.is_initialized() and mmap_backed(p.state.value) for p in params(loaded).values())


def test_saving_over_a_file_is_atomic(tmp_path, monkeypatch):
    """A failure while a lazy parameter's provider runs mid-save leaves the old file as it was."""
    path = tmp_path / "model.bpk"
    Mixed(seed=1).save_file(path)
    before = path.read_bytes()
    monkeypatch.setattr(initializers, "evaluate", lambda *a: (_ for _ in ()).throw(MemoryError("mid-save")))
    with pytest.raises(MemoryError):
        Mixed().save_file(path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["model.bpk"]


# Burn's MNIST model ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mnist():
    """examples/mnist_burn.py, imported from its path."""
    if not FIXTURE.exists():
        pytest.skip(f"Burn's MNIST burnpack is not at {FIXTURE} (shared/fixtures/burn/mnist-model.bpk)")
    spec = importlib.util.spec_from_file_location("mnist_burn", ROOT / "examples" / "mnist_burn.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_burns_mnist_weights_load_with_their_ids(mnist):
    model = mnist.load(FIXTURE)
    with BurnpackFile.open(FIXTURE) as pack:
        loaded = params(model)
        assert set(loaded) == set(pack.entries)
        for name, entry in pack.entries.items():
            assert loaded[name].id == entry.param_id
            np.testing.assert_array_equal(loaded[name].state.value, pack.array(name))


def test_burns_mnist_model_runs_deterministically_and_traces(mnist):
    model = mnist.load(FIXTURE)
    digits = mnist.synthetic_digits()
    images = np.stack(list(digits.values()))
    probabilities = mnist.classify(model, images)
    assert probabilities.shape == (4, 10) and np.isfinite(probabilities).all()
    np.testing.assert_array_equal(mnist.classify(model, images), probabilities)
    predicted = dict(zip(digits, probabilities.argmax(axis=1).tolist()))
    assert (predicted["one"], predicted["seven"], predicted["zero"]) == (1, 7, 0)
    graph = kiln.trace(model, ((None, 28, 28), "f32"))
    x = mnist.normalize(images)
    (traced,) = interpret(graph, [x])
    np.testing.assert_allclose(traced, model(kiln.tensor(x)).numpy(), rtol=1e-6, atol=1e-6)


def test_load_file_errors_name_the_file(tmp_path):
    """issue 15: an error applying a file's tensors names the file, not only the tensor."""
    nn.Linear(3, 4).save_file(tmp_path / "wide")
    with pytest.raises(RecordError) as caught:
        nn.Linear(3, 2).try_load_file(tmp_path / "wide")
    assert str(caught.value).startswith(f"{tmp_path / 'wide'}: ") and "shape mismatch" in str(caught.value)


class Untied(Module):
    def __init__(self):
        self.encode = nn.Linear(4, 4)
        self.decode = nn.Linear(4, 4)


class Tied(Module):
    def __init__(self):
        self.encode = nn.Linear(4, 4)
        self.decode = nn.Linear(4, 4)
        self.decode.weight = self.encode.weight  # one parameter at two paths

    def forward(self, x):
        return self.decode(self.encode(x))


def test_tied_weights_round_trip_and_differing_tensors_with_one_id_are_refused(tmp_path):
    """issue 15: "Duplicate ParamIds load, then training fails far away". One Param at two paths is recorded
    twice with its id and loads back; a file giving two differing parameters one id is refused naming both
    (optimizer records, which tag each state tensor with its parameter's id, are not module records)."""
    tied = Tied()
    tied.save_file(tmp_path / "tied")
    back = Tied().load_file(tmp_path / "tied.bpk")
    assert back.encode.weight.id == back.decode.weight.id == tied.encode.weight.id
    path = tmp_path / "clash.bpk"
    a, b = np.zeros((4, 4), np.float32), np.ones((4, 4), np.float32)
    write_burnpack(path, [PackTensor(name, BurnDType.parse("F32"), value.shape, 7, value) for name, value in
                          [("encode.weight", a), ("encode.bias", a[0]), ("decode.weight", b), ("decode.bias", b[0])]])
    with pytest.raises(RecordError, match=r"decode.weight: the record gives it ParamId .*, as it gives "
                                          r"encode.weight, but the two differ"):
        Untied().try_load_file(path)
