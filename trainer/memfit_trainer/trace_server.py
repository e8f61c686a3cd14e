"""Imported first by the fork server that forks the profiler's trace workers (``memfit_trainer.trace_workers``
preloads it there): the server asks the kernel for SIGKILL when the profiler that started it ends.

The server ends by itself only at EOF on a pipe whose write end every worker it forked holds too, and a worker
ends when the server does (or when the profiler shuts the pool down): without this, a profiler killed mid-trace
would leave the server and its workers waiting for one another forever.
"""

from memfit.contract.lifetime import end_with_launcher

end_with_launcher()
