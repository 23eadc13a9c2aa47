//! A pickle reader that never executes anything: it evaluates protocols 0–5 symbolically into a
//! [`Value`] graph in which globals, calls (`REDUCE`), object creations (`NEWOBJ`/`BUILD`) and
//! persistent ids stay data. Typed decoders for DCP classes sit on top (`format::read_metadata`).
//!
//! Bounds: every opcode creates O(1) values besides strings and bytes that are copied from the
//! input, containers are shared by reference (`BINGET` does not copy), and the stack, memo and
//! total value count are capped, so memory is O(input length) whatever the input claims.
//! Opcode semantics: CPython `Lib/pickle.py` (`_Unpickler`) and `Lib/pickletools.py`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// A symbolic pickle value. Containers are shared (`Rc`) as in Python, so memo references and
/// mutations through them behave as `pickle.load` would, without copying.
#[derive(Clone, Debug)]
pub enum Value {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    Tuple(Rc<Vec<Value>>),
    List(Rc<RefCell<Vec<Value>>>),
    Dict(Rc<RefCell<Vec<(Value, Value)>>>),
    /// `module.name`, never imported.
    Global(Rc<(String, String)>),
    /// `callable(*args)`, never called.
    Call(Rc<(Value, Value)>),
    /// `cls.__new__(cls, *args)` then optional `BUILD` state.
    Object(Rc<ObjectValue>),
    /// A persistent id (`BINPERSID`), e.g. torch's storage reference.
    PersId(Rc<Value>),
}

// Dropping a deeply nested value recursively would overflow the thread's stack (a pickle of N
// nested tuples takes N+2 bytes). So values are dismantled iteratively: the children of every
// container that is about to die are moved into a work list first.
impl Drop for Value {
    fn drop(&mut self) {
        let mut work = Vec::new();
        take_children(self, &mut work);
        while let Some(mut v) = work.pop() {
            take_children(&mut v, &mut work);
        }
    }
}

fn take_children(v: &mut Value, out: &mut Vec<Value>) {
    let take = |v: &mut Value| std::mem::replace(v, Value::None);
    match v {
        Value::Tuple(rc) => {
            if let Some(items) = Rc::get_mut(rc) {
                out.append(items)
            }
        }
        Value::List(rc) => {
            if let Some(items) = Rc::get_mut(rc) {
                out.append(items.get_mut())
            }
        }
        Value::Dict(rc) => {
            if let Some(pairs) = Rc::get_mut(rc) {
                for (k, v) in pairs.get_mut().drain(..) {
                    out.push(k);
                    out.push(v);
                }
            }
        }
        Value::Call(rc) => {
            if let Some(pair) = Rc::get_mut(rc) {
                out.push(take(&mut pair.0));
                out.push(take(&mut pair.1));
            }
        }
        Value::Object(rc) => {
            if let Some(o) = Rc::get_mut(rc) {
                out.push(take(&mut o.class));
                out.push(take(&mut o.args));
                if let Some(s) = o.state.get_mut().take() {
                    out.push(s);
                }
            }
        }
        Value::PersId(rc) => {
            if let Some(inner) = Rc::get_mut(rc) {
                out.push(take(inner));
            }
        }
        _ => {}
    }
}

#[derive(Debug)]
pub struct ObjectValue {
    pub class: Value,
    pub args: Value,
    pub state: RefCell<Option<Value>>,
}

/// Why a pickle could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnpickleError(pub String);

impl std::fmt::Display for UnpickleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

type R<T> = Result<T, UnpickleError>;

fn err<T>(msg: impl Into<String>) -> R<T> {
    Err(UnpickleError(msg.into()))
}

/// Stack bound for small inputs. Every push consumes at least one input byte, so a larger input may
/// hold a deeper stack: the bound is `max(MAX_STACK, input.len() / 2)` (a `.metadata` of 1,000,000
/// chunks holds 2,000,000 `storage_data` items above one MARK).
const MAX_STACK: usize = 1 << 20;
const MAX_VALUES: usize = 1 << 28;

impl Value {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_int(&self) -> Option<i128> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(*b as i128),
            _ => None,
        }
    }
    /// Items of a tuple or list.
    pub fn items(&self) -> Option<Vec<Value>> {
        match self {
            Value::Tuple(t) => Some(t.as_ref().clone()),
            Value::List(l) => Some(l.borrow().clone()),
            _ => None,
        }
    }
    /// `(module, name)` of a global.
    pub fn global(&self) -> Option<(&str, &str)> {
        match self {
            Value::Global(g) => Some((g.0.as_str(), g.1.as_str())),
            _ => None,
        }
    }
    /// Looks `key` up in a dict with string keys.
    pub fn get(&self, key: &str) -> Option<Value> {
        match self {
            Value::Dict(d) => d
                .borrow()
                .iter()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v.clone()),
            _ => None,
        }
    }
    /// A short description for error messages.
    pub fn kind(&self) -> String {
        self.kind_at(0)
    }

    fn kind_at(&self, depth: usize) -> String {
        if depth > 4 {
            return "...".into();
        }
        match self {
            Value::None => "None".into(),
            Value::Bool(_) => "bool".into(),
            Value::Int(_) => "int".into(),
            Value::Float(_) => "float".into(),
            Value::Str(_) => "str".into(),
            Value::Bytes(_) => "bytes".into(),
            Value::Tuple(_) => "tuple".into(),
            Value::List(_) => "list".into(),
            Value::Dict(_) => "dict".into(),
            Value::Global(g) => format!("global {}.{}", g.0, g.1),
            Value::Call(c) => format!("call of {}", c.0.kind_at(depth + 1)),
            Value::Object(o) => format!("object of {}", o.class.kind_at(depth + 1)),
            Value::PersId(_) => "persistent id".into(),
        }
    }
}

enum Slot {
    Mark,
    V(Value),
}

struct Vm<'a> {
    input: &'a [u8],
    pos: usize,
    stack: Vec<Slot>,
    memo: HashMap<u32, Value>,
    created: usize,
    /// Every mutable container created, so that [`Unpickled`] can break reference cycles.
    arena: Vec<Value>,
}

/// The result of [`unpickle`]: the root value, plus ownership of every mutable container so that
/// cycles a hostile pickle builds (a list appended to itself) are broken when this is dropped.
pub struct Unpickled {
    root: Value,
    arena: Vec<Value>,
}

impl std::ops::Deref for Unpickled {
    type Target = Value;
    fn deref(&self) -> &Value {
        &self.root
    }
}

impl Drop for Unpickled {
    fn drop(&mut self) {
        // Every cycle passes through a list, a dict or an object state (tuples and calls are
        // immutable once built), so emptying those breaks them all.
        let mut work = Vec::new();
        for v in &self.arena {
            match v {
                Value::List(l) => work.append(&mut l.borrow_mut()),
                Value::Dict(d) => {
                    for (k, v) in d.borrow_mut().drain(..) {
                        work.push(k);
                        work.push(v);
                    }
                }
                Value::Object(o) => work.extend(o.state.borrow_mut().take()),
                _ => {}
            }
        }
    }
}

impl<'a> Vm<'a> {
    fn take(&mut self, n: usize) -> R<&'a [u8]> {
        if n > self.input.len() - self.pos {
            return err(format!(
                "truncated pickle: {n} bytes wanted at offset {}",
                self.pos
            ));
        }
        let s = &self.input[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u8(&mut self) -> R<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> R<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> R<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> R<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn line(&mut self) -> R<&'a str> {
        let rest = &self.input[self.pos..];
        let n = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| UnpickleError("unterminated text line".into()))?;
        self.pos += n + 1;
        std::str::from_utf8(&rest[..n]).map_err(|_| UnpickleError("text line is not UTF-8".into()))
    }
    fn push(&mut self, v: Value) -> R<()> {
        if matches!(v, Value::List(_) | Value::Dict(_) | Value::Object(_)) {
            self.arena.push(v.clone());
        }
        self.created += 1;
        if self.stack.len() >= MAX_STACK.max(self.input.len() / 2) || self.created > MAX_VALUES {
            return err("pickle too large (stack or value count over the limit)");
        }
        self.stack.push(Slot::V(v));
        Ok(())
    }
    fn pop(&mut self) -> R<Value> {
        match self.stack.pop() {
            Some(Slot::V(v)) => Ok(v),
            Some(Slot::Mark) => err("unexpected MARK on the stack"),
            None => err("stack underflow"),
        }
    }
    fn top(&mut self) -> R<&Value> {
        match self.stack.last() {
            Some(Slot::V(v)) => Ok(v),
            _ => err("stack underflow"),
        }
    }
    fn pop_mark(&mut self) -> R<Vec<Value>> {
        let at = self
            .stack
            .iter()
            .rposition(|s| matches!(s, Slot::Mark))
            .ok_or_else(|| UnpickleError("MARK missing".into()))?;
        let items = self
            .stack
            .split_off(at + 1)
            .into_iter()
            .map(|s| match s {
                Slot::V(v) => v,
                Slot::Mark => unreachable!(),
            })
            .collect();
        self.stack.pop();
        Ok(items)
    }
    fn memo_put(&mut self, idx: u32) -> R<()> {
        let v = self.top()?.clone();
        if self.memo.len() >= MAX_STACK.max(self.input.len() / 2) * 64 {
            return err("memo too large");
        }
        self.memo.insert(idx, v);
        Ok(())
    }
    fn memo_get(&mut self, idx: u32) -> R<()> {
        let v = self
            .memo
            .get(&idx)
            .cloned()
            .ok_or_else(|| UnpickleError(format!("memo key {idx} missing")))?;
        self.push(v)
    }
    fn str_value(bytes: &[u8]) -> R<Value> {
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(Value::Str(Rc::from(s))),
            Err(_) => err("string is not UTF-8"),
        }
    }
    fn set_items(&mut self, pairs: Vec<Value>) -> R<()> {
        if pairs.len() % 2 != 0 {
            return err("SETITEMS with an odd item count");
        }
        match self.top()? {
            Value::Dict(d) => {
                let mut d = d.borrow_mut();
                let mut it = pairs.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    d.push((k, v));
                }
                Ok(())
            }
            other => err(format!("SETITEM(S) on a {}", other.kind())),
        }
    }
    fn append(&mut self, items: Vec<Value>) -> R<()> {
        match self.top()? {
            Value::List(l) => {
                l.borrow_mut().extend(items);
                Ok(())
            }
            other => err(format!("APPEND(S) on a {}", other.kind())),
        }
    }

    fn run(&mut self) -> R<Value> {
        loop {
            let op = self.u8()?;
            match op {
                0x80 => {
                    let proto = self.u8()?;
                    if proto > 5 {
                        return err(format!("unsupported pickle protocol {proto}"));
                    }
                }
                0x95 => {
                    self.u64()?; // FRAME: only a framing hint
                }
                b'.' => return self.pop(),
                b'(' => self.stack.push(Slot::Mark),
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?.clone();
                    self.push(v)?;
                }
                b'N' => self.push(Value::None)?,
                0x88 => self.push(Value::Bool(true))?,
                0x89 => self.push(Value::Bool(false))?,
                b'J' => {
                    let v = i32::from_le_bytes(self.take(4)?.try_into().unwrap());
                    self.push(Value::Int(v as i128))?
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push(Value::Int(v as i128))?
                }
                b'M' => {
                    let v = self.u16()?;
                    self.push(Value::Int(v as i128))?
                }
                0x8a | 0x8b => {
                    let n = if op == 0x8a {
                        self.u8()? as usize
                    } else {
                        self.u32()? as usize
                    };
                    let b = self.take(n)?;
                    if n > 16 {
                        return err("integer wider than 128 bits");
                    }
                    let mut buf = [if b.last().is_some_and(|&x| x & 0x80 != 0) {
                        0xff
                    } else {
                        0
                    }; 16];
                    buf[..n].copy_from_slice(b);
                    self.push(Value::Int(i128::from_le_bytes(buf)))?
                }
                b'I' => {
                    let line = self.line()?;
                    let v = match line {
                        "01" => Value::Bool(true),
                        "00" => Value::Bool(false),
                        s => Value::Int(
                            s.parse()
                                .map_err(|_| UnpickleError(format!("bad INT {s:?}")))?,
                        ),
                    };
                    self.push(v)?
                }
                b'L' => {
                    let line = self.line()?;
                    let v = line
                        .trim_end_matches('L')
                        .parse()
                        .map_err(|_| UnpickleError(format!("bad LONG {line:?}")))?;
                    self.push(Value::Int(v))?
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.take(8)?.try_into().unwrap());
                    self.push(Value::Float(v))?
                }
                b'F' => {
                    let line = self.line()?;
                    let v = line
                        .parse()
                        .map_err(|_| UnpickleError(format!("bad FLOAT {line:?}")))?;
                    self.push(Value::Float(v))?
                }
                b'X' => {
                    let n = self.u32()? as usize;
                    let v = Self::str_value(self.take(n)?)?;
                    self.push(v)?
                }
                0x8c => {
                    let n = self.u8()? as usize;
                    let v = Self::str_value(self.take(n)?)?;
                    self.push(v)?
                }
                0x8d => {
                    let n = self.u64()?;
                    let v = Self::str_value(self.take(usize::try_from(n).unwrap_or(usize::MAX))?)?;
                    self.push(v)?
                }
                b'V' => {
                    let line = self.line()?;
                    self.push(Value::Str(Rc::from(line)))?
                }
                b'S' => {
                    let line = self.line()?;
                    self.push(Value::Str(Rc::from(
                        line.trim_matches(|c| c == '\'' || c == '"'),
                    )))?
                }
                b'U' | b'T' | b'C' | b'B' | 0x8e | 0x96 => {
                    let n = match op {
                        b'U' | b'C' => self.u8()? as usize,
                        b'T' | b'B' => self.u32()? as usize,
                        _ => usize::try_from(self.u64()?).unwrap_or(usize::MAX),
                    };
                    let b = self.take(n)?;
                    // SHORT_BINSTRING/BINSTRING are py2 str: keep text when it is UTF-8.
                    let v = if matches!(op, b'U' | b'T') {
                        Self::str_value(b).unwrap_or_else(|_| Value::Bytes(Rc::from(b)))
                    } else {
                        Value::Bytes(Rc::from(b))
                    };
                    self.push(v)?
                }
                b')' => self.push(Value::Tuple(Rc::new(Vec::new())))?,
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Value::Tuple(Rc::new(items)))?
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.push(Value::Tuple(Rc::new(items)))?
                }
                b']' => self.push(Value::List(Rc::new(RefCell::new(Vec::new()))))?,
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Value::List(Rc::new(RefCell::new(items))))?
                }
                b'}' => self.push(Value::Dict(Rc::new(RefCell::new(Vec::new()))))?,
                b'd' => {
                    let items = self.pop_mark()?;
                    self.push(Value::Dict(Rc::new(RefCell::new(Vec::new()))))?;
                    self.set_items(items)?
                }
                0x8f => self.push(Value::List(Rc::new(RefCell::new(Vec::new()))))?, // EMPTY_SET as a list
                0x90 => {
                    let items = self.pop_mark()?;
                    self.append(items)?
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    self.push(Value::Tuple(Rc::new(items)))? // FROZENSET as a tuple
                }
                b'a' => {
                    let v = self.pop()?;
                    self.append(vec![v])?
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    self.append(items)?
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.set_items(vec![k, v])?
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.set_items(items)?
                }
                b'p' => {
                    let line = self.line()?;
                    let idx = line
                        .parse()
                        .map_err(|_| UnpickleError(format!("bad PUT {line:?}")))?;
                    self.memo_put(idx)?
                }
                b'q' => {
                    let idx = self.u8()? as u32;
                    self.memo_put(idx)?
                }
                b'r' => {
                    let idx = self.u32()?;
                    self.memo_put(idx)?
                }
                0x94 => {
                    let idx = self.memo.len() as u32;
                    self.memo_put(idx)?
                }
                b'g' => {
                    let line = self.line()?;
                    let idx = line
                        .parse()
                        .map_err(|_| UnpickleError(format!("bad GET {line:?}")))?;
                    self.memo_get(idx)?
                }
                b'h' => {
                    let idx = self.u8()? as u32;
                    self.memo_get(idx)?
                }
                b'j' => {
                    let idx = self.u32()?;
                    self.memo_get(idx)?
                }
                b'c' => {
                    let module = self.line()?.to_string();
                    let name = self.line()?.to_string();
                    self.push(Value::Global(Rc::new((module, name))))?
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (module.as_str(), name.as_str()) {
                        (Some(m), Some(n)) => {
                            self.push(Value::Global(Rc::new((m.to_string(), n.to_string()))))?
                        }
                        _ => return err("STACK_GLOBAL needs two strings"),
                    }
                }
                b'R' => {
                    let args = self.pop()?;
                    let func = self.pop()?;
                    self.push(Value::Call(Rc::new((func, args))))?
                }
                0x81 => {
                    let args = self.pop()?;
                    let class = self.pop()?;
                    self.push(Value::Object(Rc::new(ObjectValue {
                        class,
                        args,
                        state: RefCell::new(None),
                    })))?
                }
                0x92 => {
                    let _kwargs = self.pop()?;
                    let args = self.pop()?;
                    let class = self.pop()?;
                    self.push(Value::Object(Rc::new(ObjectValue {
                        class,
                        args,
                        state: RefCell::new(None),
                    })))?
                }
                b'b' => {
                    let state = self.pop()?;
                    match self.top()? {
                        Value::Object(o) => *o.state.borrow_mut() = Some(state),
                        // BUILD on a call result (e.g. an object from copyreg): keep it as an object.
                        other => {
                            let o = Value::Object(Rc::new(ObjectValue {
                                class: other.clone(),
                                args: Value::Tuple(Rc::new(Vec::new())),
                                state: RefCell::new(Some(state)),
                            }));
                            self.pop()?;
                            self.push(o)?
                        }
                    }
                }
                b'Q' => {
                    let pid = self.pop()?;
                    self.push(Value::PersId(Rc::new(pid)))?
                }
                b'P' => {
                    let line = self.line()?;
                    self.push(Value::PersId(Rc::new(Value::Str(Rc::from(line)))))?
                }
                0x97 => {} // NEXT_BUFFER-less READONLY_BUFFER: no-op on our values
                other => {
                    return err(format!(
                        "unsupported pickle opcode 0x{other:02x} at offset {}",
                        self.pos - 1
                    ))
                }
            }
        }
    }
}

/// Reads one pickle from `input` as data.
///
/// Errors: [`UnpickleError`] for malformed or truncated input, unsupported opcodes (`INST`, `OBJ`,
/// `EXT*`, out-of-band buffers) and inputs over the size limits.
pub fn unpickle(input: &[u8]) -> Result<Unpickled, UnpickleError> {
    let mut vm = Vm {
        input,
        pos: 0,
        stack: Vec::new(),
        memo: HashMap::new(),
        created: 0,
        arena: Vec::new(),
    };
    let result = vm.run();
    // Whatever happened, the arena ends up in an Unpickled, whose Drop breaks its cycles.
    let mut out = Unpickled {
        root: Value::None,
        arena: std::mem::take(&mut vm.arena),
    };
    drop(vm);
    out.root = result?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::pickle::Pickler;

    #[test]
    fn reads_back_what_the_emitter_writes() {
        let mut p = Pickler::new(true);
        p.global("torch", "Size");
        p.int_tuple(&[2, 3, 1 << 40]);
        p.tuple(1);
        p.reduce();
        let v = unpickle(&p.finish()).unwrap();
        let Value::Call(c) = &*v else { panic!() };
        assert_eq!(c.0.global(), Some(("torch", "Size")));
        let dims = c.1.items().unwrap()[0].items().unwrap();
        assert_eq!(
            dims.iter().map(|d| d.as_int().unwrap()).collect::<Vec<_>>(),
            vec![2, 3, 1 << 40]
        );
    }

    #[test]
    fn deep_nesting_neither_overflows_nor_hangs() {
        let mut deep = b"K\x00".to_vec();
        deep.extend(std::iter::repeat_n(0x85u8, 1_000_000));
        deep.push(b'.');
        let v = unpickle(&deep).unwrap();
        assert!(v.kind().starts_with("tuple"));
        let mut lists = vec![b']'; 300_000];
        lists.extend(std::iter::repeat_n(b'a', 299_999));
        lists.push(b'.');
        drop(unpickle(&lists).unwrap());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for input in [
            &b""[..],
            b"\x80\x02",
            b"(((",
            b"h\x05.",
            b"\x8a\xff",
            b"\x93.",
            b"u.",
            b"\xff",
        ] {
            assert!(unpickle(input).is_err(), "{input:?}");
        }
    }
}
