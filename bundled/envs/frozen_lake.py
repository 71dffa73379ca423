"""FrozenLake as a text environment: Gymnasium's FrozenLake-v1 on a random map drawn from the
reset seed (gymnasium.envs.toy_text.frozen_lake.generate_random_map), so every seed is a new
lake and a group of trajectories reset with one seed plays one lake.

The observation is the lake, one row a line: P the player, H a hole, G the goal, . ice. The
action is one of left, down, right, up (the model answers <answer>down</answer>). Reaching G
gives reward 1 and ends the game (info["success"] True); a hole ends it with 0.
"""

import gymnasium
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

ACTIONS = ("left", "down", "right", "up")  # FrozenLake-v1's actions 0..3


class TextFrozenLake(gymnasium.Env):
    def __init__(self, size: int = 4, p: float = 0.8, is_slippery: bool = False):
        self.size, self.p, self.is_slippery = size, p, is_slippery
        self.observation_space = gymnasium.spaces.Text(max_length=size * (size + 1))
        self.action_space = gymnasium.spaces.Text(max_length=5)
        self.lake = None

    def render_text(self) -> str:
        row, col = divmod(int(self.lake.unwrapped.s), self.size)
        lines = []
        for r, cells in enumerate(self.desc):
            cells = ["." if c in "SF" else c for c in cells]
            if r == row:
                cells[col] = "P"
            lines.append("".join(cells))
        return "\n".join(lines)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.desc = generate_random_map(size=self.size, p=self.p, seed=seed)
        self.lake = gymnasium.make("FrozenLake-v1", desc=self.desc, is_slippery=self.is_slippery)
        self.lake.reset(seed=seed)
        return self.render_text(), {}

    def step(self, action: str):
        if action not in ACTIONS:
            return self.render_text(), 0.0, False, False, {"action_is_valid": False}
        _, reward, terminated, truncated, _ = self.lake.step(ACTIONS.index(action))
        info = {"success": bool(terminated and reward > 0)} if terminated else {}
        return self.render_text(), float(reward), terminated, truncated, info
