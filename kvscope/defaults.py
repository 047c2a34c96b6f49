"""Every default of the vocabulary (docs/concepts.md), written once.

Tracing, the analyses, the policies, replay and the live cache take these; a store records
the values it was traced with (``ds.kvscope.w``, ``ds.kvscope.n_sink``), and everything that
reads a store uses the recorded values, not these.
"""

W = 8  # window size w: positions per window after the sinks (a multiple of 4)
N_SINK = 4  # sinks: the first positions, kept by every policy
OBS_WINDOW = 32  # last prefill rows stored (SnapKV's observation window)
BLOCK_STEPS = 32  # decode steps per written block (one chunk of rows)
MAX_NEW_TOKENS = 64

HORIZON = 32  # FMM horizon H (steps)
TOP_FRAC = 0.2  # ρ of the history oracle
LOCAL = 64  # newest tokens a policy always keeps (the history oracle's protected tail)
LIR_MISSES = 4  # m: consecutive misses before an inactive episode is eligible
LIR_HORIZON = 8  # H_lir: events after eligibility in which a reactivation counts
LIR_LAG = 1  # δ of P01 / P10
PEAKS_TOP_K = 8  # peaks per row
LOGQUANT_W = 32  # LogQuant's W (docs/concepts.md#logquant)
N_BOOT = 1000  # bootstrap resamples
N_BOOT_PEAKS = 200  # α refits are costlier: fewer resamples
ANALYSIS_TASK_BYTES = 64 * 2**20  # stored rows one analysis task reads in one call (open_trace(chunks="analysis"))
REPLAY_TASK_BYTES = 2 * 2**30  # what one replay task may hold (auto layers per task, kvscope.replay.plan)
REPLAY_FORK_CELLS = 5 * 10**7  # run × step × unit × position cells from which a replay forks workers (~1 s)
FORCED_CHUNK = 64  # decode steps per forward of forced replay (its closed loop converges chunk by chunk)
FORCED_MAX_ROUNDS = 8  # forwards of one chunk before forced replay stops and labels the sample not converged
