"""Learning a policy: the simulator built from recorded episodes (:mod:`core.rl.sim`), the
masked PPO trainer (:mod:`core.rl.ppo`), runs and their lifecycle (:mod:`core.rl.runs`),
held-out evaluation and off-policy estimates (:mod:`core.rl.evaluation`,
:mod:`core.rl.ope`), training diagnostics (:mod:`core.rl.doctor`) and the RDE baseline
fit on expert actions (:mod:`core.rl.rde`).

May import: :mod:`core.state` and everything below it.
"""
