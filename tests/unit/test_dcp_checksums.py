"""``torch.distributed.checkpoint`` with psrt's checksums, in one process (``no_dist=True``):
a checkpoint written by :class:`ChecksummedWriter` loads equal through
:class:`ChecksummedReader`, and a flipped byte, a truncated, missing or swapped file, or a
``.metadata`` rewritten without its files is refused naming the file, before anything is
loaded.  The same on 2 and 4 ranks over psrt's backend is in
tests/parallel/scripts/torch_backend_check.py (``dcp/checksums_...``)."""
from __future__ import annotations

import hashlib
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from psrt.checkpoint.dcp import CHECKSUMS, ChecksummedReader, ChecksummedWriter
from psrt.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(16, 8, generator=generator), "bias": torch.randn(8, generator=generator),
            "progress": {"epoch": seed}}


def zeros() -> dict:
    return {"weight": torch.zeros(16, 8), "bias": torch.zeros(8), "progress": {"epoch": -1}}


def save(path: Path, seed: int, **options) -> Path:
    dcp.save(state(seed), storage_writer=ChecksummedWriter(path, **options), no_dist=True)
    return path


def load(path: Path, destination: dict, **options) -> dict:
    dcp.load(destination, storage_reader=ChecksummedReader(path, **options), no_dist=True)
    return destination


def assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key


def refusal(path: Path, **options) -> str:
    """The psrt error a load from ``path`` is refused with, after checking that the
    destination was left as it was."""
    destination = zeros()
    with pytest.raises(CheckpointException) as caught:
        load(path, destination, **options)
    assert_equal(destination, zeros())
    (error, _), = caught.value.failures.values()
    assert isinstance(error, CheckpointError), repr(error)
    assert str(error) in str(caught.value)  # torch's message on every rank carries psrt's
    return str(error)


def flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return save(tmp_path / "saved", seed=1)


def test_round_trip_loads_what_was_saved(saved):
    assert_equal(load(saved, zeros()), state(1))


def test_checksums_are_plain_data_in_the_metadata_that_torch_reads_alone(saved):
    class WithoutPsrt(pickle.Unpickler):
        def find_class(self, module, name):
            assert not module.startswith("psrt"), f".metadata refers to {module}.{name}"
            return super().find_class(module, name)

    with open(saved / ".metadata", "rb") as f:
        metadata = WithoutPsrt(f).load()
    files = sorted(p.name for p in saved.glob("*.distcp"))
    assert getattr(metadata, CHECKSUMS) == {
        name: {"bytes": (saved / name).stat().st_size, "sha256": hashlib.sha256((saved / name).read_bytes()).hexdigest()}
        for name in files}
    plain = zeros()
    dcp.load(plain, checkpoint_id=saved, no_dist=True)  # torch's own FileSystemReader
    assert_equal(plain, state(1))


def test_a_flipped_byte_of_a_weight_is_refused_naming_the_file(saved):
    """torch's own reader loads this file silently, with one weight 4 times off."""
    data = bytearray((saved / "__0_0.distcp").read_bytes())
    at = data.find(state(1)["weight"].numpy().tobytes())
    assert at >= 0
    data[at + 3] ^= 0x01  # an exponent bit of weight[0, 0]
    (saved / "__0_0.distcp").write_bytes(bytes(data))
    plain = zeros()
    dcp.load(plain, checkpoint_id=saved, no_dist=True)  # torch's own FileSystemReader
    assert not torch.equal(plain["weight"], state(1)["weight"]) and torch.equal(plain["bias"], state(1)["bias"])
    message = refusal(saved)
    assert f"{saved / '__0_0.distcp'} was changed after it was saved" in message


def test_a_flipped_byte_anywhere_else_is_refused_naming_the_file(saved):
    flip_middle_byte(saved / "__0_0.distcp")
    assert f"{saved / '__0_0.distcp'} was changed after it was saved" in refusal(saved)


def test_a_truncated_file_is_refused_naming_the_file(saved):
    data = (saved / "__0_0.distcp").read_bytes()
    (saved / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    assert f"{saved / '__0_0.distcp'} has {len(data) // 2} bytes, {len(data)} were saved" in refusal(saved)


def test_a_missing_file_is_refused_naming_the_file(saved):
    (saved / "__0_0.distcp").unlink()
    assert f"{saved / '__0_0.distcp'} is missing" in refusal(saved)


def test_a_file_of_another_save_is_refused_naming_the_file(saved, tmp_path):
    other = save(tmp_path / "other", seed=2)
    assert (other / "__0_0.distcp").stat().st_size == (saved / "__0_0.distcp").stat().st_size
    shutil.copy(other / "__0_0.distcp", saved / "__0_0.distcp")
    assert f"{saved / '__0_0.distcp'} was changed after it was saved, or belongs to another save" in refusal(saved)


def test_two_files_of_one_save_swapped_are_refused(tmp_path):
    saved = save(tmp_path / "per_item", seed=1, single_file_per_rank=False)
    first, second = sorted(saved.glob("*.distcp"))[:2]
    first_bytes = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(first_bytes)
    message = refusal(saved)
    assert str(first) in message or str(second) in message


def test_a_metadata_rewritten_without_its_files_is_refused(saved, tmp_path):
    """The .metadata of another save beside these files: the records it holds are not theirs."""
    other = save(tmp_path / "other", seed=2)
    shutil.copy(other / ".metadata", saved / ".metadata")
    assert f"{saved / '__0_0.distcp'} was changed after it was saved, or belongs to another save" in refusal(saved)


def test_a_metadata_without_a_files_record_is_refused(saved):
    with open(saved / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    getattr(metadata, CHECKSUMS).pop("__0_0.distcp")
    with open(saved / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    assert "records no size and sha256 for __0_0.distcp" in refusal(saved)


def test_only_the_files_a_load_reads_are_checked(tmp_path):
    saved = save(tmp_path / "per_item", seed=1, single_file_per_rank=False)
    metadata = ChecksummedReader(saved).read_metadata()
    bias_file = next(info.relative_path for index, info in metadata.storage_data.items() if index.fqn == "bias")
    flip_middle_byte(saved / bias_file)
    assert_equal(load(saved, {"weight": torch.zeros(16, 8)}), {"weight": state(1)["weight"]})
    assert f"{saved / bias_file} was changed" in refusal(saved)


def test_a_checkpoint_without_checksums_is_refused_unless_allowed(tmp_path):
    plain = tmp_path / "plain"
    dcp.save(state(1), checkpoint_id=plain, no_dist=True)  # torch's own FileSystemWriter
    message = refusal(plain)
    assert f"{plain / '.metadata'} records no checksums" in message and "allow_unverified=True" in message
    assert_equal(load(plain, zeros(), allow_unverified=True), state(1))


def test_a_save_over_several_threads_records_every_file(tmp_path):
    saved = save(tmp_path / "threads", seed=1, thread_count=2)
    metadata = ChecksummedReader(saved).read_metadata()
    assert sorted(getattr(metadata, CHECKSUMS)) == sorted(p.name for p in saved.glob("*.distcp"))
    assert len(getattr(metadata, CHECKSUMS)) == 2
    assert_equal(load(saved, zeros()), state(1))
