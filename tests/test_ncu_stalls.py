"""scripts/ncu_stalls.py reads an Nsight Compute source page (plain or gzipped; its first kernel): the reasons'
shares, the instructions with the most samples and what came before them; a file that is no such page is refused
by name."""
import gzip
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = ['"Address"', '"Source"', '"Warp Stall Sampling (All Samples)"', '"stall_long_sb"', '"stall_math"',
          '"stall_long_sb (Not Issued)"']
PAGE = "\n".join([
    '"Kernel Name","kq_mma",',
    ",".join(HEADER),
    '"0x10","  LDG.E.128.CONSTANT R32, desc[UR4][R96.64]","2","0","2","0"',
    '"0x20","  PRMT R44, R44, 0x4140, R123","1","0","1","0"',
    '"0x30","  HMMA.16816.F32.BF16 R44, R44, R32, RZ","9","8","1","5"',
    '"0x40","  FFMA R1, R2, R3, R1","","","",""',
]) + "\n"


def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "ncu_stalls.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_digest_of_a_source_page(tmp_path):
    plain, packed = PAGE.encode(), gzip.compress(PAGE.encode())
    for path, data in ((tmp_path / "page.csv", plain), (tmp_path / "page.csv.gz", packed)):
        path.write_bytes(data)
        out = run(path, "--top", "1", "--before", "2")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == "12 samples over 4 instructions"
        # long_sb 8 of 12, math 4 of 12; the Not Issued column is not a reason of its own
        assert lines[1].split() == ["long_sb", "8", "66.7%"] and lines[2].split() == ["math", "4", "33.3%"]
        top = next(i for i, line in enumerate(lines) if "HMMA" in line)
        assert lines[top].split()[:2] == ["9", "(75.0%)"] and lines[top].endswith("long_sb 8, math 1")
        assert "LDG.E.128.CONSTANT" in lines[top + 1] and "PRMT" in lines[top + 2] and len(lines) == top + 3


def test_only_the_first_kernel_is_read(tmp_path):
    path = tmp_path / "two.csv"
    path.write_text(PAGE + PAGE.replace('"9","8","1","5"', '"90","80","10","5"'))
    out = run(path, "--top", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "12 samples over 4 instructions"


def test_a_file_that_is_no_source_page_is_refused(tmp_path):
    path = tmp_path / "details.txt"
    path.write_text("Section: GPU Speed Of Light Throughput\n")
    out = run(path)
    assert out.returncode == 2 and f"{path}: no row with Address, Source" in out.stderr
