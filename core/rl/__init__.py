"""Learning a policy: the simulator built from recorded episodes (:mod:`core.rl.sim`), the
environment protocol the trainer reads (:mod:`core.rl.env`), the policy network
(:mod:`core.rl.agent`), the masked PPO trainer (:mod:`core.rl.ppo`) with its workspace
loading (:mod:`core.rl.loading`), checkpoints (:mod:`core.rl.checkpoints`) and evaluation
rollouts (:mod:`core.rl.rollouts`), runs and their lifecycle (:mod:`core.rl.runs`),
held-out evaluation and off-policy estimates (:mod:`core.rl.evaluation`,
:mod:`core.rl.ope`), training diagnostics (:mod:`core.rl.doctor`) and the RDE baseline
fit on expert actions (:mod:`core.rl.rde`).

May import: :mod:`core.state` and everything below it.
"""
