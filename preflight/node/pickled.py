"""The plain data of a pickle (dicts, lists, tuples, strings, numbers, booleans, None) read without unpickling it:
pickletools.genops splits the opcode stream and a small stack machine builds only that data; every object the
pickle would construct or call (GLOBAL, REDUCE, NEWOBJ, a persistent id such as torch's storages) stays an Opaque
placeholder, nothing is imported or called. A checkpoint is untrusted input (preflight's CKPT facts)."""
import pickletools

MAX_OPS = 2000000  # past this the stream is not read further: None


class Opaque(object):
    """An object the pickle would have built: its class or callable's name where the stream says it, the
    arguments it would have been called with and the state it would have been given (BUILD: a dataclass's
    fields), as plain data or Opaque, never used to call anything."""

    __slots__ = ("name", "args", "state")

    def __init__(self, name, args=()):
        self.name, self.args, self.state = name, args, None

    def __repr__(self):
        return "Opaque(%s%s)" % (self.name, "" if not self.args else ", %r" % (self.args,))


_MARK = object()
_SCALARS = {"BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG", "BINFLOAT", "FLOAT", "BINUNICODE",
            "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING", "BINBYTES",
            "SHORT_BINBYTES", "BINBYTES8"}
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}


def plain_data(data):
    """The pickle's top-level value as plain data (Opaque where an object would be); None where the stream is not
    a pickle this reader follows (an opcode it does not know, a broken stream, more than MAX_OPS opcodes)."""
    stack, memo = [], {}

    def since_mark():
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is _MARK:
                items = stack[i + 1:]
                del stack[i:]
                return items
        raise ValueError("no mark")

    try:
        for count, (op, arg, _) in enumerate(pickletools.genops(data)):
            name = op.name
            if count > MAX_OPS:
                return None
            if name in _SCALARS:
                stack.append(arg)
            elif name in _CONSTANTS:
                stack.append(_CONSTANTS[name])
            elif name in ("PROTO", "FRAME"):
                continue
            elif name == "STOP":
                return stack[-1] if stack else None
            elif name == "MARK":
                stack.append(_MARK)
            elif name == "EMPTY_DICT":
                stack.append({})
            elif name == "EMPTY_LIST":
                stack.append([])
            elif name == "EMPTY_TUPLE":
                stack.append(())
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                size = int(name[-1])
                items = tuple(stack[-size:])
                del stack[-size:]
                stack.append(items)
            elif name == "TUPLE":
                stack.append(tuple(since_mark()))
            elif name == "DICT":
                items = since_mark()
                stack.append(_pairs({}, items))
            elif name == "LIST":
                stack.append(since_mark())
            elif name == "SETITEM":
                value, key = stack.pop(), stack.pop()
                _pairs(stack[-1], [key, value])
            elif name == "SETITEMS":
                items = since_mark()
                _pairs(stack[-1], items)
            elif name == "APPEND":
                value = stack.pop()
                if isinstance(stack[-1], list):
                    stack[-1].append(value)
            elif name == "APPENDS":
                items = since_mark()
                if isinstance(stack[-1], list):
                    stack[-1].extend(items)
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                stack.append(memo[arg])
            elif name == "GLOBAL":
                stack.append(Opaque(str(arg).replace(" ", ".")))
            elif name == "STACK_GLOBAL":
                attribute, module = stack.pop(), stack.pop()
                stack.append(Opaque("%s.%s" % (module, attribute)))
            elif name in ("REDUCE", "NEWOBJ"):
                args = stack.pop()  # never passed to anything: kept to be read (ZeroStageEnum(2))
                made = stack.pop()
                stack.append(Opaque(made.name if isinstance(made, Opaque) else "?",
                                    args if isinstance(args, tuple) else ()))
            elif name == "NEWOBJ_EX":
                del stack[-2:]
                made = stack.pop()
                stack.append(Opaque(made.name if isinstance(made, Opaque) else "?"))
            elif name == "BUILD":
                state = stack.pop()
                if isinstance(stack[-1], Opaque):
                    stack[-1].state = state
            elif name == "BINPERSID":
                stack.pop()
                stack.append(Opaque("persistent"))
            elif name == "POP":
                stack.pop()
            elif name == "POP_MARK":
                since_mark()
            elif name == "DUP":
                stack.append(stack[-1])
            else:
                return None
    except (ValueError, IndexError, KeyError, TypeError):
        return None
    return None


def _pairs(target, items):
    if isinstance(target, dict):
        for key, value in zip(items[0::2], items[1::2]):
            try:
                target[key] = value
            except TypeError:  # an unhashable key (a list): not plain data
                pass
    return target
