"""The error an options object (``LossOptions``, ``SamplingConfig``, ...) raises for a setting that cannot work.
Each options object validates its own fields, once; the config names the key (``section.field``)."""


class OptionError(ValueError):
    """``field`` names the setting; the message reads "<field> <what is wrong>"."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field} {message}")
        self.field, self.message = field, message
