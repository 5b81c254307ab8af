#!/usr/bin/env python3
"""Tests of tools/recipe_accuracy.py and recipe_gemm_error on a tiny language model (ctest
tools.recipe_accuracy):

    python3 tools/test_recipe_accuracy.py BUILD_DIR

  - every operand error is within the bound its format's unit roundoff and smallest subnormal
    give, and every GEMM error within the bound its operands' errors give (derived below, never
    read from the program's output);
  - with one activation element 10^6 times the rest, the finer recipes' forward error is below
    tensorwise's;
  - the tool's pooling of the per-layer errors on numbers worked by hand;
  - bad input is one line and exit status 2: a missing executable, a recipe stage 06 does not
    run, sizes whose blocks a shard would cut, and recipe_gemm_error's own flags.
"""
import json
import math
import pathlib
import subprocess
import sys
import tempfile
import unittest

TOOLS = pathlib.Path(__file__).resolve().parent
BUILD = pathlib.Path(sys.argv.pop(1) if len(sys.argv) > 1 else "build")
EXE = BUILD / "bin" / "recipe_gemm_error"
sys.path.insert(0, str(TOOLS))
import recipe_accuracy  # noqa: E402

TINY = ["--task", "lm", "--data", "synthetic", "--vocab", "64", "--hidden", "64", "--heads", "4",
        "--ffn", "128", "--layers", "1", "--seq", "16", "--batch", "2", "--steps", "3",
        "--optimizer", "adamw", "--lr", "1e-3"]
ALL = "tensorwise,rowwise,block128,mxfp8,nvfp4"

# The OCP formats (common/fp8_bits.h, common/lowp_bits.h): mantissa bits, exponent bias, largest
# finite value, and emax, the exponent of the largest power of two (mxfp8's scale rule).
FORMATS = {"e4m3": (3, 7, 448.0, 8), "e5m2": (2, 15, 57344.0, 15), "e2m1": (1, 1, 6.0, 2)}


def run(cmd, timeout=60):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)


def gemm_errors(tmp, *extra, recipes=ALL):
    out = pathlib.Path(tmp) / "errors.json"
    r = run([EXE, *TINY, "--recipes", recipes, "--gemm-errors", out, *extra])
    if r.returncode != 0:
        raise AssertionError(r.stdout[-2000:] + r.stderr[-2000:])
    return json.loads(out.read_text())


def operand_bound(recipe, op):
    """The largest ‖A' − A‖_F / ‖A‖_F a recipe's casts can make of the operand A.

    One pass of scale, cast and unscale moves an element x by at most ρ|x| + δ: ρ the relative
    error of a round to nearest with m mantissa bits, 2^-(m+1), and δ half the smallest subnormal
    step, 2^(1 − bias − m) / 2, over the smallest scale a block can get. An fp32 scale
    (tensorwise, rowwise, block128) is fmax / amax_block ≥ fmax / amax. mxfp8's scale 1/X is
    2^(emax − ⌊log2 amax_block⌋) ≥ 2^emax / amax, and it saturates a block's largest elements
    between fmax and 2^(emax+1) to fmax: at most 1 − fmax / 2^(emax+1) = 1/8 for E4M3 and E5M2,
    so its ρ is 1/8. (nvfp4's two-level scale is left out: its bound needs the UE4M3 scale's own
    rounding.) Summed over n elements: ‖A' − A‖_F ≤ ρ‖A‖_F + δ√n. Two passes (the stage
    re-quantizes a gathered operand along the tokens) give (2ρ + ρ²)‖A‖_F + (2 + 2ρ)δ√n, the
    second pass's amax being at most (1 + ρ) amax. 1e-6 covers the fp32 rounding of x · scale and
    of the unscale.
    """
    m, bias, fmax, emax = FORMATS[op["element"]]
    rho = 2.0 ** -(m + 1)
    step = 2.0 ** (1 - bias - m)
    if recipe == "mxfp8":
        rho = max(rho, 1.0 - fmax / 2.0 ** (emax + 1))
        delta = step / 2 * op["amax"] / 2.0 ** emax
    else:
        delta = step / 2 * op["amax"] / fmax
    if op["passes"] == 2:
        rho, delta = 2 * rho + rho * rho, (2 + 2 * rho) * delta
    return rho + delta * math.sqrt(op["n"]) / op["frobenius"] + 1e-6


class GemmErrors(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        cls.plain = gemm_errors(cls.dir.name, "--emulate-ranks", "2")
        cls.outlier = gemm_errors(cls.dir.name, "--outlier", "1e6",
                                  recipes="tensorwise,rowwise,block128,mxfp8")

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def test_every_layer_gemm_and_recipe_is_measured(self):
        g = self.plain["gemms"]
        self.assertEqual(len(g), 5 * 7 * 3)  # recipes × the block's linear layers × GEMMs
        for r in ALL.split(","):
            for kind in recipe_accuracy.KINDS:
                names = {x["weight"] for x in g if x["recipe"] == r and x["kind"] == kind}
                self.assertEqual(names, {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"})

    def test_operand_errors_are_within_the_formats_bound(self):
        checked = 0
        for g in self.plain["gemms"]:
            if g["recipe"] == "nvfp4":
                continue
            for op in (g["a"], g["b"]):
                self.assertGreater(op["rel_error"], 0.0, g)  # something was quantized
                self.assertLessEqual(op["rel_error"], operand_bound(g["recipe"], op), g)
                checked += 1
        self.assertEqual(checked, 4 * 21 * 2)

    def test_gemm_errors_are_within_the_bound_of_their_operands(self):
        # C' − C = ΔA·B + A·ΔB + ΔA·ΔB, and ‖XY‖_F ≤ ‖X‖_F ‖Y‖_F: the GEMM's error is at most
        # ‖A‖‖B‖(e_A + e_B + e_A e_B). A product of operands other than the quantized ones
        # (another orientation, another layer's) lands far outside it.
        for g in self.plain["gemms"]:
            a, b = g["a"], g["b"]
            ea, eb = a["rel_error"], b["rel_error"]
            bound = a["frobenius"] * b["frobenius"] * (ea + eb + ea * eb)
            self.assertLessEqual(g["rel_frobenius"] * g["frobenius"], bound * (1 + 1e-9), g)
            self.assertGreater(g["rel_frobenius"], 0.0, g)
            self.assertLessEqual(g["max_rel"], 1.0, g)

    def test_an_outlier_costs_tensorwise_more_than_the_finer_scales(self):
        # One element 10^6 times the rest: a tensor-wide E4M3 scale of 448 / (10^6 amax) sends
        # every other element below half of E4M3's smallest subnormal (448e-6 < 2^-10), to zero,
        # so every row of x·W but the outlier's is lost: their error is all of them, 1. A row's
        # scale, a 1 × 128 block's (K = 64: one per row) or a 1 × 32 block's keeps those rows
        # within the operand bounds above (a few per cent). Without the outlier, no such gap.
        forward = [g for g in self.outlier["gemms"] if g["kind"] == "forward"]
        self.assertEqual(len(forward), 4 * 7)
        for g in forward:
            other = g["other_rows"]["rel_frobenius"]
            if g["recipe"] == "tensorwise":
                self.assertGreater(other, 0.99, g)
            else:
                self.assertLess(other, 0.1, g)
        plain = {r: recipe_accuracy.pooled(self.plain["gemms"], r, "forward")[0]
                 for r in ("tensorwise", "block128")}
        self.assertLess(plain["tensorwise"], 2 * plain["block128"], plain)
        self.assertNotIn("other_rows", self.plain["gemms"][0])


class Pooling(unittest.TestCase):
    def test_pooled_error_weighs_each_gemm_by_its_size(self):
        g = [{"recipe": "rowwise", "kind": "dgrad", "rel_frobenius": 0.1, "frobenius": 3.0,
              "max_rel": 0.5},
             {"recipe": "rowwise", "kind": "dgrad", "rel_frobenius": 0.2, "frobenius": 4.0,
              "max_rel": 0.25},
             {"recipe": "rowwise", "kind": "wgrad", "rel_frobenius": 9.0, "frobenius": 1.0,
              "max_rel": 9.0}]
        pool, worst, mx, n = recipe_accuracy.pooled(g, "rowwise", "dgrad")
        # sqrt((0.3² + 0.8²) / (3² + 4²)) = sqrt(0.73 / 25)
        self.assertAlmostEqual(pool, math.sqrt(0.73 / 25), places=12)
        self.assertEqual((worst, mx, n), (0.2, 0.5, 2))


class BadInput(unittest.TestCase):
    def tool(self, *args):
        return run([sys.executable, TOOLS / "recipe_accuracy.py", *args])

    def one_line(self, r, *words):
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        for w in words:
            self.assertIn(w, r.stderr)
        self.assertNotIn("Traceback", r.stderr)

    def test_a_missing_executable(self):
        with tempfile.TemporaryDirectory() as d:
            self.one_line(self.tool("--bin-dir", d, "--work", pathlib.Path(d) / "w"),
                          "--bin-dir", "recipe_gemm_error")

    def test_a_word_that_names_no_recipe(self):
        self.one_line(self.tool("--bin-dir", BUILD / "bin", "--recipes", "rowwise,fp6"),
                      "--recipes", "fp6")

    def test_blocks_a_shard_would_cut(self):
        self.one_line(self.tool("--bin-dir", BUILD / "bin", "--recipes", "block128",
                                "--hidden", "128", "--ffn", "256"), "block128", "--hidden")

    def test_the_programs_own_flags(self):
        with tempfile.TemporaryDirectory() as d:
            out = pathlib.Path(d) / "e.json"
            for flags, words in ((["--recipes", "fp4"], ["--recipes", "fp4"]),
                                 (["--recipes", "rowwise", "--emulate-ranks", "3"],
                                  ["--emulate-ranks"]),
                                 (["--recipes", "rowwise", "--outlier", "-1"], ["--outlier"]),
                                 (["--recipes", "rowwise", "--outlier", "1e300"],
                                  ["--outlier", "2^64"]),
                                 (["--recipes", "rowwise", "--eval-every", "2"],
                                  ["--eval-every"])):
                r = run([EXE, *TINY, "--gemm-errors", out, *flags])
                self.one_line(r, *words)
                self.assertFalse(out.exists())


if __name__ == "__main__":
    unittest.main()
