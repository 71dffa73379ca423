"""--agent-fn's side in the worker processes (common.rewards.RewardPool), a feature: the user's agent, called with an
`openai` client on its trajectory's base_url of the run's endpoint (common.agents.endpoint)."""

from common.errors import UsageError
from common.scoring import load_from_file

EXTRA = 'pip install -e ".[agents]"'


def load_agent(spec: str):
    """The user's function of `path.py[:name]` (name: run), called as fn(client, row); it returns the reward (a
    number, or a dict with "score")."""
    user = load_from_file(spec, "--agent-fn", "run")
    try:
        import openai
    except ImportError:
        raise UsageError(f"--agent-fn: agents get an openai client; {EXTRA}") from None

    def call(base_url: str, api_key: str, row: dict, timeout: float):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)
        try:
            return user(client, row)
        finally:
            client.close()

    return call
