"""Reward Workbench core library."""
