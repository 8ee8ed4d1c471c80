"""CPU checks of the stop-19 benchmark scripts: ``benchmarks/ncu_step.py`` (Nsight Compute CSV
reading and the summary table) and ``benchmarks/sustained_gemm.py`` (argument errors, the
summary of a recorded H200 run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ncu_step  # noqa: E402
import sustained_gemm  # noqa: E402

#: an ``ncu --csv --page raw`` file: a log line, the header, the units row, two kernels (one
#: with thousands separators, units in K/M/G and usecond)
CSV = '''==PROF== Connected to process 1
"ID","Process ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum","lts__t_bytes.sum","sm__cycles_elapsed.avg.per_second","smsp__inst_executed.sum"
"","","","Mbyte","Kbyte","usecond","Gbyte","Ghz","inst"
"0","1","void cutlass::device_kernel<Foo<int>>(Params)","1,500.5","200","2,000.0","10.5","1.50","1,000,000"
"1","1","_gluon_kernel","750","100","1000","5.25","1.60","500000"
'''


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_read_csv_scales_units_to_base(tmp_path):
    kernels = ncu_step.read_csv(_write(tmp_path, "k.csv", CSV))
    assert [k["name"] for k in kernels] == ["void cutlass::device_kernel<Foo<int>>(Params)",
                                            "_gluon_kernel"]
    first = kernels[0]
    assert first["dram__bytes_read.sum"] == pytest.approx(1500.5e6)
    assert first["dram__bytes_write.sum"] == pytest.approx(200e3)
    assert first["gpu__time_duration.sum"] == pytest.approx(2e6)  # ns
    assert first["lts__t_bytes.sum"] == pytest.approx(10.5e9)
    assert first["sm__cycles_elapsed.avg.per_second"] == pytest.approx(1.5e9)
    assert first["smsp__inst_executed.sum"] == 1e6


def test_summary_totals_and_ratio(tmp_path):
    a = _write(tmp_path, "a.csv", CSV)
    half = CSV.replace('"1,500.5"', '"750.25"')  # half the first kernel's DRAM reads
    b = _write(tmp_path, "b.csv", half)
    text = ncu_step.summarize([a, b])
    assert "device_kernel" in text and "_gluon_kernel" in text
    # totals of a: DRAM read 1500.5 + 750 MB, time 3000 us
    assert "TOTAL" in text and "2250.5" in text and "3000.0" in text
    ratio = (750.25 + 750) / (1500.5 + 750)
    assert f"dram__bytes_read {ratio:.3f}" in text
    assert "gpu__time_duration 1.000" in text


def test_short_names():
    assert ncu_step.short_name("void cutlass::device_kernel<A<B>>(P)") == "device_kernel"
    assert ncu_step.short_name("_gluon_wgrad_kernel") == "_gluon_wgrad_kernel"


def test_read_csv_without_header_names_the_file(tmp_path):
    path = _write(tmp_path, "empty.csv", "==ERROR== no kernels were profiled\n")
    with pytest.raises(ValueError, match=r"empty\.csv: no ncu CSV header"):
        ncu_step.read_csv(path)


@pytest.mark.parametrize("argv, match", [
    ([], "--shape and --peer are required"),
    (["--shape", "E8_T16384_H4096_FF14336", "--peer", "x", "--warmup", "0"],
     "--warmup: expected >= 1"),
])
def test_ncu_step_argument_errors(argv, match, capsys):
    with pytest.raises(SystemExit):
        ncu_step.main(argv)
    assert match in capsys.readouterr().err


def test_ncu_step_metrics_line(capsys):
    assert ncu_step.main(["--metrics"]) == 0
    assert capsys.readouterr().out.strip().split(",") == list(ncu_step.METRICS)


@pytest.mark.parametrize("argv, match", [
    (["--gemms", "fc3"], "--gemms: expected names among"),
    (["--shapes", "E1"], "--shapes: expected names among"),
    (["--variants", "{bad"], "--variants: expected JSON"),
    (["--variants", "[1]"], "--variants: expected a JSON object of objects"),
    (["--variants", '{"triton": {}}'], "'triton' are reserved names"),
    (["--rounds", "0"], "--rounds >= 1 and --block-ms > 0 expected, got 0"),
])
def test_sustained_argument_errors(argv, match, capsys):
    with pytest.raises(SystemExit):
        sustained_gemm.main(argv)
    assert match in capsys.readouterr().err


def test_sustained_needs_cuda(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        sustained_gemm.main([])
    assert "needs a CUDA device" in capsys.readouterr().err


def test_sustained_summary_of_a_recorded_run():
    path = ROOT / "benchmarks" / "results" / "h200_sustained_wgrad_group_n_2026-12-01_stop19.jsonl"
    text = sustained_gemm.summarize(str(path))
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["shape", "gemm", "variant", "ms"]
    # 3 shapes x 2 wgrads x (grouped_mm, default, gn4, gn8, gn16)
    assert len(lines) == 1 + 3 * 2 * 5
    assert any("fc2_wgrad" in line and "gn8" in line and "True" in line for line in lines)


def test_wait_hint_pattern_patches_hintless_waits_only():
    """``--wait-hint-ns``'s PTX rewrite: Triton 3.6's wait loop (no hint) gets the hint, a
    wait that already has one (CUTLASS-style) is left alone."""
    text = ("mbarrier.try_wait.parity.shared.b64 complete, [%r899], %r60;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 P1, [%r1], %r2, 5;\n")
    new, count = sustained_gemm._TRY_WAIT.subn(r"\1, 7;", text)
    assert count == 1
    assert "complete, [%r899], %r60, 7;" in new and "[%r1], %r2, 5;" in new


def test_wait_hint_argument_error(capsys):
    with pytest.raises(SystemExit):
        sustained_gemm.main(["--wait-hint-ns", "-1"])
    assert "--wait-hint-ns: expected >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize("name, short", [
    # the anonymous namespaces of PyTorch's kernels (the H200 CSVs of stop 19): the old
    # cut at the first "<" left "" or "void"
    ("void at::<unnamed>::CatArrayBatchedCopy_alignedK_contig<at::<unnamed>::OpaqueType<4>, "
     "unsigned int, 1, 128, 1, 16>(T1 *, at::<unnamed>::CatArrInputTensorMetadata<T1>)",
     "CatArrayBatchedCopy_alignedK_contig"),
    ("void <unnamed>::elementwise_kernel_with_index<int, at::arange_cuda_out(const c10::Scalar "
     "&)::[lambda() (instance 1)]>(int, T2, T3::type *)", "elementwise_kernel_with_index"),
    ("void (anonymous namespace)::foo_kernel<float>(float *)", "foo_kernel"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>(T3)", "reduce_kernel"),
])
def test_short_names_of_anonymous_namespaces(name, short):
    assert ncu_step.short_name(name) == short


def test_short_names_of_the_recorded_csvs_are_never_empty():
    for path in sorted((ROOT / "benchmarks" / "results").glob("h200_ncu_*_stop19.csv")):
        names = [ncu_step.short_name(str(k["name"])) for k in ncu_step.read_csv(str(path))]
        assert names and all(n and n != "void" for n in names), (path.name, names)


def test_read_csv_short_units(tmp_path):
    """The H200's ncu writes ``ns`` and ``hz`` (base units); ``us`` / ``ms`` scale."""
    text = CSV.replace('"usecond"', '"us"').replace('"Ghz"', '"hz"').replace('"1.50"', '"1500"')
    first = ncu_step.read_csv(_write(tmp_path, "s.csv", text))[0]
    assert first["gpu__time_duration.sum"] == pytest.approx(2e6)
    assert first["sm__cycles_elapsed.avg.per_second"] == pytest.approx(1500)
    text = CSV.replace('"usecond"', '"ms"')
    first = ncu_step.read_csv(_write(tmp_path, "m.csv", text))[0]
    assert first["gpu__time_duration.sum"] == pytest.approx(2e9)


def test_read_csv_unknown_unit_names_file_metric_and_unit(tmp_path):
    """An unknown unit raises instead of being read as the base unit (a silent 10^3 off)."""
    path = _write(tmp_path, "u.csv", CSV.replace('"Mbyte"', '"Mibyte"'))
    with pytest.raises(ValueError, match=r"u\.csv: metric dram__bytes_read\.sum in unit "
                                         r"'Mibyte', expected one of"):
        ncu_step.read_csv(path)


def test_read_csv_without_kernel_name_column_names_the_file(tmp_path):
    path = _write(tmp_path, "n.csv", CSV.replace('"Kernel Name"', '"Name"'))
    with pytest.raises(ValueError, match=r"n\.csv: the ncu CSV header has no \"Kernel Name\""):
        ncu_step.read_csv(path)


def test_instant_power_reading_shared_with_power_clock():
    """``sustained_gemm`` reads power with ``power_clock.instant_power_w``: W from the field's
    mW, NaN without the field, on an NVML error or a failed field."""
    from types import SimpleNamespace

    import power_clock

    assert sustained_gemm.instant_power_w is power_clock.instant_power_w

    class Err(Exception):
        pass

    def fake(ret=0, raises=False, has_field=True):
        def values(handle, fids):
            if raises:
                raise Err()
            return [SimpleNamespace(nvmlReturn=ret, value=SimpleNamespace(uiVal=650500))]
        nv = SimpleNamespace(NVMLError=Err, nvmlDeviceGetFieldValues=values)
        if has_field:
            nv.NVML_FI_DEV_POWER_INSTANT = 186
        return nv

    assert power_clock.instant_power_w(fake(), None) == 650.5
    for nv in (fake(ret=3), fake(raises=True), fake(has_field=False)):
        assert power_clock.instant_power_w(nv, None) != power_clock.instant_power_w(nv, None)
