"""Plumbing shared by the recipes: config bases, data, model, ops, parallel, checkpoint, tracking.

Nothing here decides how a recipe learns (advantage, loss, aggregation): that stays in the recipe.
"""
