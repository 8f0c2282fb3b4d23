"""kiln.runtime.tvm: Relax lowering rules, the build pipeline and target, CPU schedules, tuning, the compile cache,
executables and artifacts."""
