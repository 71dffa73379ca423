"""An interaction for the bundled tool task (interactions.yaml): a grader that tells the model
when its answer is wrong and lets it try again, with verl's interaction methods.

A row opts in through extra_info.interaction_kwargs, e.g. {"name": "grader", "ground_truth":
"936"}; each reply's score (1.0 right, 0.0 wrong) reaches the reward function in
extra_info["rollout_reward_scores"]["user_turn_rewards"], as in verl.
"""

import re


class Grader:
    def __init__(self, config: dict):
        self.config, self.truth = config, {}

    async def start_interaction(self, instance_id: str, ground_truth: str | None = None, **kwargs) -> str:
        self.truth[instance_id] = str(ground_truth)
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict], **kwargs):
        found = re.findall(r"<answer>(.*?)</answer>", messages[-1]["content"])
        if found and found[-1].strip() == self.truth[instance_id]:
            return True, "Correct.", 1.0, {}
        said = f"<answer>{found[-1]}</answer> is wrong" if found else "I see no <answer></answer>"
        return False, f"{said}; try again.", 0.0, {}

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        self.truth.pop(instance_id, None)
