"""Chat: turns through the model's chat template in one context-shift cache, shifts that drop whole turns."""

from selfextend.chat.session import ChatSession
from selfextend.chat.sessionfile import ChatError, ChatStats, SavedSettings, saved_settings
from selfextend.chat.template import ChatTemplate
from selfextend.chat.turns import Exchange, ShiftReport, TurnLedger

__all__ = [
    "ChatError",
    "ChatSession",
    "ChatStats",
    "ChatTemplate",
    "Exchange",
    "SavedSettings",
    "ShiftReport",
    "TurnLedger",
    "saved_settings",
]
