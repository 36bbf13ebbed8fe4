"""Every use of DeepSpeed beyond its documented API, in one place: this package, by concern.

Each hook says why we need it. `hooks.HOOKS` lists what each hook relies on in the
installed DeepSpeed (`tests/test_deepspeed_compat.py` checks every entry), so an
upgrade that moves one fails a named test instead of training wrongly.
setup.py pins DeepSpeed to the range these were checked against.

Callers import the module of the concern they use (nothing is re-exported here):
    pipeline          our stage split, layer files, tied copies, wrappers of the engine's instructions
    dualpipev         --pipeline-schedule dualpipev: our module as DualPipeVModule, a rank's two stages, the schedules'
                      instruction streams
    checkpoint_files  file names, classes allowed when loading, checkpoint IO, parameter owners
    optimizer_state   the wrapped optimizer: partitions, master weights, moments, loss scaler, step counters
    startup           print()ed start-up lines, log level, process groups' time-out
    experts           Mixture of Experts: expert groups, parameter marks, optimizer groups, norms
    hooks             HOOKS (the one list) and resolve
The package is at the bottom: its modules import torch, DeepSpeed, the standard library and each other only.
"""
