"""Delay levels, timer messages and retry backoff (SCHEDULE_TOPIC_XXXX, rmq_sys_wheel_timer)."""
from .levels import DEFAULT_DELAY_LEVELS, SCHEDULE_TOPIC, TIMER_TOPIC, DelayLevels, Diverted, parse_delay_levels
from .progress import PROGRESS_TOPIC
from .service import ScheduleService, diverted_request

__all__ = ["DEFAULT_DELAY_LEVELS", "SCHEDULE_TOPIC", "TIMER_TOPIC", "PROGRESS_TOPIC", "DelayLevels", "Diverted",
           "ScheduleService", "diverted_request", "parse_delay_levels"]
