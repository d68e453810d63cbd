"""RemotingCommand: the one message type of RocketMQ remoting, in both header codecs.

JSON header (serialize type 0, spec 1.3): a JSON object with keys
``code language version opaque flag remark extFields`` (``serializeTypeCurrentRPC``
is informational and ignored). Real clients send ext field values as strings,
numbers or booleans, and ``language`` as a name or a number; all are accepted.
We always write ext field values as strings, because the Go and C++ clients
decode them strictly as strings.

ROCKETMQ binary header (serialize type 1, spec 1.4), big-endian:

    offset  size  field
    0       2     code (short)
    2       1     language (byte)
    3       2     version (short)
    5       4     opaque (int)
    9       4     flag (int)
    13      4     remark length R (0 = no remark)
    17      R     remark (UTF-8)
    17+R    4     ext length E
    21+R    E     entries: key length (short), key, value length (int), value

A response is encoded in the serialization its request used, so a client that
cannot read one kind (old C++ clients read the header word unmasked) never
receives it.
"""
from __future__ import annotations

import json
import re
import struct
from typing import Iterable, Sequence

from .codes import FLAG_ONEWAY, FLAG_RESPONSE, VERSION_4_9_8, LanguageCode, ResponseCode, SerializeType
from .errors import FrameError, HeaderError, HeaderTooLargeError
from .frame import HEADER_LENGTH_MASK, MAX_FRAME_SIZE, MAX_HEADER_SIZE, PREFIX, check_prefix

_BIN_FIXED = struct.Struct(">hBhiii")  # code, language, version, opaque, flag, remark length: 17 bytes
_I32 = struct.Struct(">i")
_I16 = struct.Struct(">h")
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_LANG_BY_NAME = {lang.name: int(lang) for lang in LanguageCode}
_LANG_NAME = {int(lang): lang.name for lang in LanguageCode}
_json_loads = json.JSONDecoder().decode
_json_scan = json.JSONDecoder().scan_once      # (obj, end) from a str index; StopIteration if no value there
_JSON_SPACE = " \t\n\r"                          # what json.loads skips around a document
_json_str = json.encoder.encode_basestring      # a str as a JSON string literal, non-ASCII kept (C)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

BodyParts = Sequence[bytes | bytearray | memoryview]


class RemotingCommand:
    """A request or response. ``body`` is bytes, or a sequence of buffers to send without joining."""

    __slots__ = ("code", "language", "version", "opaque", "flag", "remark", "ext_fields", "body", "serialize_type")

    def __init__(self, code: int, *, language: int = LanguageCode.JAVA, version: int = VERSION_4_9_8,
                 opaque: int = 0, flag: int = 0, remark: str | None = None,
                 ext_fields: dict[str, str] | None = None, body: bytes | BodyParts = b"",
                 serialize_type: int = SerializeType.JSON):
        self.code = code
        self.language = language
        self.version = version
        self.opaque = opaque
        self.flag = flag
        self.remark = remark
        self.ext_fields = ext_fields if ext_fields is not None else {}
        self.body = body
        self.serialize_type = serialize_type

    # ----------------------------------------------------------------- kinds
    @property
    def is_response(self) -> bool:
        return bool(self.flag & FLAG_RESPONSE)

    @property
    def is_oneway(self) -> bool:
        return bool(self.flag & FLAG_ONEWAY)

    @classmethod
    def request(cls, code: int, ext_fields: dict | None = None, body: bytes = b"", *, oneway: bool = False,
                opaque: int = 0, language: int = LanguageCode.PYTHON, version: int = VERSION_4_9_8,
                remark: str | None = None, serialize_type: int = SerializeType.JSON) -> "RemotingCommand":
        fields = {k: _field_text(v) for k, v in ext_fields.items() if v is not None} if ext_fields else {}
        return cls(code, language=language, version=version, opaque=opaque, flag=FLAG_ONEWAY if oneway else 0,
                   remark=remark, ext_fields=fields, body=body, serialize_type=serialize_type)

    def response(self, code: int = ResponseCode.SUCCESS, remark: str | None = None,
                 ext_fields: dict | None = None, body: bytes | BodyParts = b"") -> "RemotingCommand":
        """The response to this request: same opaque and serialization, response bit set."""
        fields = {k: _field_text(v) for k, v in ext_fields.items() if v is not None} if ext_fields else {}
        return RemotingCommand(code, language=LanguageCode.JAVA, version=VERSION_4_9_8, opaque=self.opaque,
                               flag=FLAG_RESPONSE, remark=remark, ext_fields=fields, body=body,
                               serialize_type=self.serialize_type)

    def __repr__(self) -> str:
        kind = "response" if self.is_response else ("oneway" if self.is_oneway else "request")
        return (f"RemotingCommand({kind} code={self.code} opaque={self.opaque} remark={self.remark!r} "
                f"ext_fields={self.ext_fields!r} body={self.body_length()}B)")

    def body_length(self) -> int:
        body = self.body
        if isinstance(body, (bytes, bytearray, memoryview)):
            return len(body)
        return sum(len(part) for part in body)

    def body_bytes(self) -> bytes:
        body = self.body
        if isinstance(body, bytes):
            return body
        if isinstance(body, (bytearray, memoryview)):
            return bytes(body)
        return b"".join(body)

    # -------------------------------------------------------------- encoding
    def encode_header(self) -> bytes:
        if self.serialize_type == 1:  # SerializeType.ROCKETMQ; a literal, as enum member lookups are slow
            return self._encode_binary_header()
        return self._encode_json_header()

    def encode_parts(self) -> list:
        """Buffers that together make the frame; the body parts are not copied."""
        header = self.encode_header()
        body = self.body
        if isinstance(body, (bytes, bytearray, memoryview)):
            body_len = len(body)
            parts = [body] if body_len else []
        else:
            if isinstance(body, str):   # list() would make it characters, found out only by the write of the turn
                raise TypeError("a command body is bytes-like (or a list of bytes-like parts), not str")
            parts = list(body)
            body_len = sum(len(p) for p in parts)
        prefix = PREFIX.pack(4 + len(header) + body_len, (self.serialize_type << 24) | len(header))
        return [prefix + header, *parts]

    def encode(self) -> bytes:
        return b"".join(self.encode_parts())

    def _encode_json_header(self) -> bytes:
        # Written by hand rather than through json.dumps of a dict (a third of the cost):
        # keys in fastjson's sorted order, strings escaped by the json module itself.
        esc = _json_str
        ext = self.ext_fields
        if ext:
            try:
                fields = ",".join([esc(k) + ":" + esc(v) for k, v in ext.items()])
            except TypeError:  # a value set by hand as a number or bool: sent as text, like Java
                fields = ",".join([esc(str(k)) + ":" + esc(_field_text(v)) for k, v in ext.items() if v is not None])
            head = '{"code":%d,"extFields":{%s},' % (self.code, fields)
        else:
            head = '{"code":%d,' % self.code
        remark = "" if self.remark is None else '"remark":%s,' % esc(self.remark)
        return ('%s"flag":%d,"language":"%s","opaque":%d,%s"serializeTypeCurrentRPC":"JSON","version":%d}' % (
            head, self.flag, _LANG_NAME.get(self.language, "OTHER"), self.opaque, remark, self.version)).encode()

    def _encode_binary_header(self) -> bytes:
        remark = self.remark.encode() if self.remark else b""
        out = [_BIN_FIXED.pack(self.code, self.language & 0xFF, self.version, self.opaque, self.flag, len(remark)),
               remark]
        entries = []
        for key, value in self.ext_fields.items():
            if key is None or value is None:
                continue
            k = key.encode()
            v = value.encode()
            entries.append(_I16.pack(len(k)) + k + _I32.pack(len(v)) + v)
        ext = b"".join(entries)
        out.append(_I32.pack(len(ext)))
        out.append(ext)
        return b"".join(out)

    # -------------------------------------------------------------- decoding
    @classmethod
    def decode(cls, frame: bytes | bytearray | memoryview, max_frame_size: int = MAX_FRAME_SIZE) -> "RemotingCommand":
        """Decode one whole frame, 4-byte length prefix included."""
        n = len(frame)
        if n < 8:
            raise FrameError(f"frame of {n} bytes is shorter than the 8-byte prefix")
        length, word = PREFIX.unpack_from(frame, 0)
        if length != n - 4:
            raise FrameError(f"frame length field says {length} bytes but {n - 4} follow it")
        header_length = word & HEADER_LENGTH_MASK
        if header_length > length - 4:  # the only check_prefix rule a whole frame of n >= 8 bytes can break
            check_prefix(length, word, max(max_frame_size, length))
        if header_length > MAX_HEADER_SIZE:
            raise HeaderTooLargeError(f"the command header of {header_length} bytes is over the broker's maximum of "
                                      f"{MAX_HEADER_SIZE}: not read")
        stype = (word >> 24) & 0xFF
        header = frame[8:8 + header_length]
        body = bytes(frame[8 + header_length:])
        if stype == 0:    # SerializeType.JSON (plain ints: an IntEnum compare costs more than this branch)
            cmd = _decode_json_fast(cls, header)
            if cmd is None:
                cmd = cls._decode_json_header(header)
        elif stype == 1:  # SerializeType.ROCKETMQ
            cmd = cls._decode_binary_header(header)
        else:
            raise HeaderError(f"unknown serialize type {stype}")
        cmd.body = body
        cmd.serialize_type = stype
        return cmd

    @classmethod
    def _decode_json_header(cls, header) -> "RemotingCommand":
        # Hot path: each field is first tried as the type real clients send
        # (``type(x) is int``/``str``, no coercion); anything else goes through
        # the lenient, fully checked helpers below, with the same result.
        raw = bytes(header)
        try:
            text = raw.decode("utf-8")
            try:
                # json.loads minus its Python wrapper; the fallback gives json.loads' own
                # answer for what the bare scanner refuses (leading whitespace, nothing).
                obj, end = _json_scan(text, 0)
                if end != len(text) and text[end:].strip(_JSON_SPACE):
                    raise ValueError(f"extra data after the JSON object at {end}")
            except StopIteration:
                obj = _json_loads(text)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise HeaderError(f"JSON header does not parse: {exc}") from None
        return _json_command(cls, obj, raw)

    @classmethod
    def _decode_binary_header(cls, header) -> "RemotingCommand":
        header = bytes(header)
        n = len(header)
        if n < 21:
            raise HeaderError(f"ROCKETMQ header of {n} bytes is shorter than its 21 fixed bytes")
        code, language, version, opaque, flag, remark_len = _BIN_FIXED.unpack_from(header, 0)
        pos = 17
        if remark_len < 0 or pos + remark_len + 4 > n:
            raise HeaderError(f"remark length {remark_len} runs past the header")
        remark = _utf8(header[pos:pos + remark_len], "remark") if remark_len else None
        pos += remark_len
        (ext_len,) = _I32.unpack_from(header, pos)
        pos += 4
        if ext_len < 0 or pos + ext_len != n:
            raise HeaderError(f"ext fields length {ext_len} does not fill the header's remaining {n - pos} bytes")
        ext: dict[str, str] = {}
        unpack_i16, unpack_i32 = _I16.unpack_from, _I32.unpack_from
        try:  # one handler for the loop: no per-field helper call or message formatting
            while pos < n:
                if pos + 2 > n:
                    raise HeaderError("ext field key length cut short")
                (klen,) = unpack_i16(header, pos)
                pos += 2
                if klen < 0 or pos + klen + 4 > n:
                    raise HeaderError(f"ext field key length {klen} runs past the header")
                key = header[pos:pos + klen].decode("utf-8")
                pos += klen
                (vlen,) = unpack_i32(header, pos)
                pos += 4
                if vlen < 0 or pos + vlen > n:
                    raise HeaderError(f"ext field {key!r} value length {vlen} runs past the header")
                ext[key] = header[pos:pos + vlen].decode("utf-8")
                pos += vlen
        except UnicodeDecodeError:
            raise HeaderError(f"the ext field near header byte {pos} is not valid UTF-8") from None
        return _decoded(cls, code, language, version, opaque, flag, remark, ext)

    # ------------------------------------------------------- typed ext fields
    def str_field(self, key: str, default: str | None = None, *, required: bool = False) -> str | None:
        value = self.ext_fields.get(key)
        if value is None or value == "":
            if required:
                raise HeaderError(f"the header field {key} is missing")
            return default
        return value

    def int_field(self, key: str, default: int | None = None, *, required: bool = False) -> int | None:
        value = self.ext_fields.get(key)
        if value is None or value == "":
            if required:
                raise HeaderError(f"the header field {key} is missing")
            return default
        return _parse_int(value, key)

    def bool_field(self, key: str, default: bool = False) -> bool:
        value = self.ext_fields.get(key)
        if value is None or value == "":
            return default
        text = value.strip().lower()
        if text in ("true", "1"):
            return True
        if text in ("false", "0"):
            return False
        raise HeaderError(f"the header field {key}={value!r} is not a boolean")


def _json_command(cls, obj, raw: bytes) -> RemotingCommand:
    """The command a parsed JSON header (``obj``, parsed from ``raw``) holds, every field checked."""
    if type(obj) is not dict:
        raise HeaderError(f"JSON header is a {type(obj).__name__}, not an object")
    if "code" not in obj:
        raise HeaderError("JSON header has no code")
    code = obj["code"]
    version = obj.get("version", 0)
    opaque = obj.get("opaque", 0)
    flag = obj.get("flag", 0)
    if not (type(code) is type(version) is type(opaque) is type(flag) is int
            and -32768 <= code <= 32767 and -32768 <= version <= 32767
            and _INT32_MIN <= opaque <= _INT32_MAX and _INT32_MIN <= flag <= _INT32_MAX):
        code = _json_int(obj, "code", 0, -32768, 32767)
        version = _json_int(obj, "version", 0, -32768, 32767)
        opaque = _json_int(obj, "opaque", 0, _INT32_MIN, _INT32_MAX)
        flag = _json_int(obj, "flag", 0, _INT32_MIN, _INT32_MAX)
    lang = obj.get("language", "JAVA")
    language = _LANG_BY_NAME.get(lang) if type(lang) is str else None
    if language is None:
        language = _json_language(lang)
    remark = obj.get("remark")
    if remark is not None and type(remark) is not str:
        raise HeaderError(f"remark has type {type(remark).__name__}")
    ext = obj.get("extFields")
    if ext is None:
        ext = {}
    elif type(ext) is not dict:
        raise HeaderError(f"extFields is a {type(ext).__name__}, not an object")
    else:
        for value in ext.values():
            if type(value) is not str:
                ext = _json_ext_fields(ext)
                break
    if _SURROGATE_ESCAPE.search(raw):
        # JSON escapes can spell a lone surrogate, which no UTF-8 encoder
        # (ours, the record's, the reply's) can write back: refuse it here.
        for text in (remark or "", *ext.keys(), *ext.values()):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise HeaderError(f"JSON header string {text!r} holds a lone surrogate") from None
    return _decoded(cls, code, language, version, opaque, flag, remark, ext)


def _decode_json_fast(cls, header):
    """The JSON header as real clients and our broker write it, decoded inline. Any doubt after the
    parse (a type, a range, a lone surrogate) goes to _json_command with the parsed object; before
    it (not bytes, no parse, trailing text) None says "let _decode_json_header decide". Returns
    or raises only what _decode_json_header would."""
    if type(header) is not bytes:
        return None
    try:
        text = header.decode("utf-8")
        obj, end = _json_scan(text, 0)
    except (UnicodeDecodeError, StopIteration, ValueError, RecursionError):
        return None
    if end != len(text) or type(obj) is not dict:
        return None
    get = obj.get
    code = get("code")
    version = get("version", 0)
    opaque = get("opaque", 0)
    flag = get("flag", 0)
    if not (type(code) is type(version) is type(opaque) is type(flag) is int
            and -32768 <= code <= 32767 and -32768 <= version <= 32767
            and _INT32_MIN <= opaque <= _INT32_MAX and _INT32_MIN <= flag <= _INT32_MAX):
        return _json_command(cls, obj, header)
    lang = get("language", "JAVA")
    language = _LANG_BY_NAME.get(lang) if type(lang) is str else None
    remark = get("remark")
    ext = get("extFields")
    if language is None or (remark is not None and type(remark) is not str):
        return _json_command(cls, obj, header)
    if ext is None:
        ext = {}
    elif type(ext) is not dict:
        return _json_command(cls, obj, header)
    else:
        for value in ext.values():
            if type(value) is not str:  # ali-ons' numbers and booleans: as _json_command converts them
                ext = _json_ext_fields(ext)
                break
    escape = header.find(b"\\")  # one memchr; the regex (slower) only from the first backslash on
    if escape >= 0 and _SURROGATE_ESCAPE.search(header, escape):
        return _json_command(cls, obj, header)
    cmd = object.__new__(cls)
    cmd.code = code
    cmd.language = language
    cmd.version = version
    cmd.opaque = opaque
    cmd.flag = flag
    cmd.remark = remark
    cmd.ext_fields = ext
    return cmd


def _decoded(cls, code, language, version, opaque, flag, remark, ext) -> RemotingCommand:
    """A command from decoded header fields; decode() sets body and serialize_type.

    Slots are filled directly: __init__ with keyword arguments costs three times as
    much, a measurable share of decoding a frame.
    """
    cmd = object.__new__(cls)
    cmd.code = code
    cmd.language = language
    cmd.version = version
    cmd.opaque = opaque
    cmd.flag = flag
    cmd.remark = remark
    cmd.ext_fields = ext
    return cmd


def _json_language(lang) -> int:
    """A JSON ``language`` that is not an exact LanguageCode name: loose names, numbers, null."""
    if isinstance(lang, str):
        language = _LANG_BY_NAME.get(lang.strip().upper())
        if language is None:
            language = _parse_int(lang, "language", LanguageCode.OTHER) if lang.strip().isdigit() else LanguageCode.OTHER
        return language
    if isinstance(lang, int) and not isinstance(lang, bool):
        return lang & 0xFF
    if lang is None:
        return LanguageCode.JAVA
    raise HeaderError(f"language has type {type(lang).__name__}")


def _json_ext_fields(raw_ext: dict) -> dict[str, str]:
    """extFields with non-string values (ali-ons sends numbers and booleans) as text; nulls dropped."""
    ext: dict[str, str] = {}
    for key, value in raw_ext.items():
        if value is None:
            continue
        if isinstance(value, (dict, list)):
            raise HeaderError(f"extFields[{key!r}] is a {type(value).__name__}, not a scalar")
        ext[key] = _field_text(value)
    return ext


def _field_text(value) -> str:
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _parse_int(text: str, key: str, default=None) -> int:
    try:
        value = int(text.strip())
    except (ValueError, AttributeError):
        raise HeaderError(f"the header field {key}={text!r} is not an integer") from None
    if not -(1 << 63) <= value < (1 << 63):
        raise HeaderError(f"the header field {key}={text!r} is out of range")
    return value


def _json_int(obj: dict, key: str, default: int, lo: int, hi: int) -> int:
    value = obj.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise HeaderError(f"{key} has type {type(value).__name__}, not an integer")
    if isinstance(value, str):
        value = _parse_int(value, key)
    if not lo <= value <= hi:
        raise HeaderError(f"{key}={value} is out of range")
    return value


def _utf8(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise HeaderError(f"{what} is not valid UTF-8") from None


def iter_commands(frames: Iterable[bytes]) -> Iterable[RemotingCommand]:
    for frame in frames:
        yield RemotingCommand.decode(frame)
