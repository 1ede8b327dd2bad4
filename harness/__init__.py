"""Drivers of real lattice-pool processes, shared by tests/ and bench/.

- harness.procs: child environment, process tags, waiting on conditions;
- harness.worker: a worker process driven over its own pipes (WorkerProc);
- harness.pool: `lattice-pool serve` driven over stdin/stdout (PoolProc,
  and RawPool for clients that read, or do not read, the raw stream);
- harness.fakes: model dirs and configs for the fake worker (tests.fakeworker).
"""
