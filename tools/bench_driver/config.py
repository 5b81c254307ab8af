"""What the sweep runs: the repository's root, the stages and their labels, the sizes of stage 08's
and stage 09's subsections, the default config, and BenchError.
"""
import pathlib


ROOT = pathlib.Path(__file__).resolve().parent.parent.parent  # the repository
STAGES = ["01_baseline", "02_megatron_tp", "03_sequence_parallel", "04_overlap_ring",
          "05_copy_engine_async_tp", "06_fp8", "07_fsdp_tp", "08_context_parallel",
          "09_pipeline_parallel"]
# The mesh stages run at points (N, X) of their own dimension X, N = X · TP: stage 07 on D × TP
# (rows "07_fsdp_tp D<D>": 1 × 2, 2 × 1, 2 × 2), stage 08 on C × TP (rows
# "08_context_parallel C<C>": C × T = 2 × 1, 1 × 2, 2 × 2), each with its flag and json key.
MESH_STAGES = {"07_fsdp_tp": ("D", "--dp", "dp", [(2, 1), (2, 2), (4, 2)]),
               "08_context_parallel": ("C", "--cp", "cp", [(2, 2), (2, 1), (4, 2)])}


def stage_label(stage, degree=None):
    """A sweep row's stage: the executable, and for a mesh stage its own dimension's degree."""
    return f"{stage} {MESH_STAGES[stage][0]}{degree}" if stage in MESH_STAGES else stage


def split_label(label):
    """(executable, flag, degree) of a sweep row's stage; flag and degree None but on a mesh."""
    exe, _, rest = label.partition(" ")
    if exe in MESH_STAGES and rest:
        return exe, MESH_STAGES[exe][1], rest[1:]
    return exe, None, None
REFERENCE_STAGE = "03_sequence_parallel"  # the speed-up column's denominator
# Stage 08 has its own subsection (cp_plan): its meshes at two sequence lengths beside stage 03 at
# the same S and N, and attention time against S for C = 1, 2, 4 (T = 1), every run traced.
CP_STAGE = "08_context_parallel"
CP_TABLE_SEQS = {False: [128, 512], True: [128]}  # the stage table's S (quick: the default only)
CP_ATTENTION_SEQS = {False: [64, 128, 256, 512], True: [32, 64, 128]}
CP_ATTENTION_C = [1, 2, 4]
# Stage 09 has its own subsection (pp_plan): each schedule at P = 2 and 4 (T = D = C = 1) over a
# sweep of M, its measured bubble beside the schedule's formula. Small sizes: B divides by every
# M, L >= P·V at the largest P and V (quick: smaller still).
PP_STAGE = "09_pipeline_parallel"
PP_SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)]  # (name, V)
PP_DEGREES = [2, 4]
PP_MICROBATCHES = {False: [1, 2, 4, 8], True: [2, 4]}
PP_SIZES = {False: {"hidden": 128, "heads": 4, "ffn": 512, "seq": 64, "batch": 8, "layers": 8},
            True: {"hidden": 64, "heads": 4, "ffn": 128, "seq": 32, "batch": 8, "layers": 8}}
# The stages with a subsection of their own, each between the markers `<device>-<name>`.
SUBSECTIONS = {"cp": CP_STAGE, "pp": PP_STAGE}
MIB = 1024.0 * 1024.0
SECTIONS = ["cuda", "cpu", "projection"]  # the order of the sections in benchmarks.md


class BenchError(Exception):
    """A failure that stops the driver: a stage run, bad input, an incomplete output."""


# ---------------------------------------------------------------------------------------------
# Running programs.


def rel(path):
    """A path as the repository root sees it, for the commands the tables print."""
    try:
        return str(pathlib.Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


DEFAULTS = {"hidden": 256, "heads": 8, "ffn": 1024, "seq": 128, "batch": 2, "layers": 2}
SIZE_KEYS = list(DEFAULTS)


def sizes(config):
    return {**DEFAULTS, **config["set"]}


def size_text(s):
    return (f"H={s['hidden']} NH={s['heads']} F={s['ffn']} S={s['seq']} B={s['batch']} "
            f"L={s['layers']}")
