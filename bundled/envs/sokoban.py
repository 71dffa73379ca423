"""A small Sokoban as a text environment (ROLL's SimpleSokoban size: a 6x6 room, one box).

Each seed draws a room by playing backwards from the solved state: the box starts on the target
and the player pulls it 1 to 3 times, walking anywhere between pulls (so every room is solvable
and its solution pushes the box back); a room whose shortest solution is not 2 to 6 moves is
drawn again. The observation is the room, one row a line: # wall,
_ floor, O target, X box, * box on the target, P player, S player on the target. The actions are
up, down, left and right: the player walks, or pushes the box when it stands in the way and the
cell behind it is free; a move into a wall changes nothing. Solving gives reward 1 and ends the
game (info["success"] True).

With end_on_noop, a move that changes nothing (into a wall, or pushing the box into one) ends the
game as lost. A tiny policy that loses tends to repeat one such move until its budget runs out;
ending there keeps a lost game short, so its few tokens, not a long tail of repeats, carry the
push-down. A shortest solution never makes such a move, so the SFT games are the same either way.

With describe, each observation ends with a line saying where the box and the target stand from
the player ("box: 1 up 2 right; target: 2 up"), so that a model too small to find two letters in a
grid of bytes can still read the room from a few tokens.

With moves_per_turn N, an action is a plan of 1 to N moves separated by spaces ("up up left"),
played in order: the game ends on the move that solves it (or, with end_on_noop, on a move that
changes nothing), and a plan of more moves or with a word that is not a move is invalid and
changes nothing. A room's shortest solution then fits one reply, so the model reads the room once
and answers with its plan, as it answers a question; move by move, the earlier rooms of the
conversation mislead a tiny model's later turns (docs/environments.md).
"""

import random
from collections import deque

import gymnasium

ACTIONS = ("up", "down", "left", "right")
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def _reachable(walls: set, box: tuple, start: tuple) -> set:
    """Cells the player can walk to from start without moving the box."""
    seen, todo = {start}, deque([start])
    while todo:
        r, c = todo.popleft()
        for dr, dc in MOVES.values():
            cell = (r + dr, c + dc)
            if cell not in walls and cell != box and cell not in seen:
                seen.add(cell)
                todo.append(cell)
    return seen


def generate_room(seed: int, size: int = 6, pulls: tuple[int, int] = (1, 3), moves: tuple[int, int] = (2, 6)):
    """(walls, target, box, player) of a room whose shortest solution takes `moves` moves (a range), drawn
    from seed."""
    rng = random.Random(seed)
    border = {(r, c) for r in range(size) for c in range(size) if r in (0, size - 1) or c in (0, size - 1)}
    floor = [(r, c) for r in range(1, size - 1) for c in range(1, size - 1)]
    while True:
        walls = set(border) | ({rng.choice(floor)} if rng.random() < 0.5 else set())
        free = [cell for cell in floor if cell not in walls]
        target = rng.choice(free)
        box, player = target, None
        starts = [(target[0] + dr, target[1] + dc) for dr, dc in MOVES.values()]
        starts = [cell for cell in starts if cell not in walls]
        if not starts:
            continue
        player = rng.choice(starts)
        for _ in range(rng.randint(*pulls)):
            # A pull: the player, next to the box, steps away from it and drags it along.
            options = []
            for cell in _reachable(walls, box, player):
                d = (cell[0] - box[0], cell[1] - box[1])
                behind = (cell[0] + d[0], cell[1] + d[1])
                if abs(d[0]) + abs(d[1]) == 1 and behind not in walls:
                    options.append((cell, behind))
            if not options:
                break
            cell, behind = rng.choice(options)
            box, player = cell, behind
        if box != target and moves[0] <= len(solve(walls, target, box, player)) <= moves[1]:
            return walls, target, box, player


def solve(walls: set, target: tuple, box: tuple, player: tuple) -> list[str]:
    """A shortest sequence of actions that puts the box on the target (breadth-first over the
    player's and the box's cells, trying the actions in ACTIONS order)."""
    previous, todo = {(player, box): None}, deque([(player, box)])
    while todo:
        state = todo.popleft()
        if state[1] == target:
            path = []
            while previous[state] is not None:
                state, action = previous[state]
                path.append(action)
            return path[::-1]
        for action in ACTIONS:
            nxt = step_state(walls, *state, action)
            if nxt not in previous:
                previous[nxt] = (state, action)
                todo.append(nxt)
    raise ValueError("no solution")


def step_state(walls: set, player: tuple, box: tuple, action: str) -> tuple:
    dr, dc = MOVES[action]
    cell = (player[0] + dr, player[1] + dc)
    if cell in walls:
        return player, box
    if cell == box:
        behind = (box[0] + dr, box[1] + dc)
        if behind in walls:
            return player, box
        return cell, behind
    return cell, box


class SimpleSokoban(gymnasium.Env):
    def __init__(
        self,
        size: int = 6,
        min_pulls: int = 1,
        max_pulls: int = 3,
        min_moves: int = 2,
        max_moves: int = 6,
        end_on_noop: bool = False,
        describe: bool = False,
        moves_per_turn: int = 1,
    ):
        self.size, self.pulls, self.moves = size, (min_pulls, max_pulls), (min_moves, max_moves)
        self.end_on_noop, self.describe, self.moves_per_turn = end_on_noop, describe, moves_per_turn
        self.observation_space = gymnasium.spaces.Text(max_length=size * (size + 1) + 64)
        self.action_space = gymnasium.spaces.Text(max_length=6 * moves_per_turn)

    def render_text(self) -> str:
        lines = []
        for r in range(self.size):
            row = []
            for c in range(self.size):
                cell = (r, c)
                if cell in self.walls:
                    row.append("#")
                elif cell == self.box:
                    row.append("*" if cell == self.target else "X")
                elif cell == self.player:
                    row.append("S" if cell == self.target else "P")
                else:
                    row.append("O" if cell == self.target else "_")
            lines.append("".join(row))
        if self.describe:
            lines.append(f"box: {self._offset(self.box)}; target: {self._offset(self.target)}")
        return "\n".join(lines)

    def _offset(self, cell: tuple) -> str:
        dr, dc = cell[0] - self.player[0], cell[1] - self.player[1]
        parts = [f"{abs(dr)} {'down' if dr > 0 else 'up'}"] if dr else []
        parts += [f"{abs(dc)} {'right' if dc > 0 else 'left'}"] if dc else []
        return " ".join(parts) or "here"

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.walls, self.target, self.box, self.player = generate_room(seed, self.size, self.pulls, self.moves)
        return self.render_text(), {}

    def step(self, action: str):
        moves = action.split()
        if not 1 <= len(moves) <= self.moves_per_turn or any(move not in ACTIONS for move in moves):
            return self.render_text(), 0.0, False, False, {"action_is_valid": False}
        for move in moves:
            before = (self.player, self.box)
            self.player, self.box = step_state(self.walls, self.player, self.box, move)
            if self.end_on_noop and (self.player, self.box) == before:
                return self.render_text(), 0.0, True, False, {"success": False}
            if self.box == self.target:
                return self.render_text(), 1.0, True, False, {"success": True}
        return self.render_text(), 0.0, False, False, {}
