//! A pickle reader that never executes anything. One opcode decoder ([`decode`]) evaluates
//! protocols 0–5 and hands every value it makes to a [`Build`]er, which chooses the representation:
//! [`unpickle`] builds the symbolic [`Value`] graph (globals, calls (`REDUCE`), object creations
//! (`NEWOBJ`/`BUILD`) and persistent ids stay data), while `format::read_metadata` builds DCP's
//! chunk tables directly, without a generic tree.
//!
//! Bounds: every opcode consumes at least one input byte and pushes at most one value, so the
//! stack, the memo and the number of values are all at most the input length; strings and bytes
//! are borrowed from the input; containers are shared by reference (`BINGET` does not copy). So
//! memory is O(input length) whatever lengths or indices the input claims.
//! Opcode semantics: CPython `Lib/pickle.py` (`_Unpickler`), `Modules/_pickle.c` (the stack fence
//! at the last MARK, the memo) and `Lib/pickletools.py`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use crate::format::split::{Batch, LeafValue, Plan};

/// A symbolic pickle value. Containers are shared (`Rc`) as in Python, so memo references and
/// mutations through them behave as `pickle.load` would, without copying.
#[derive(Clone, Debug)]
pub enum Value {
    /// `None`.
    None,
    /// A bool.
    Bool(bool),
    /// An int (pickle's `LONG` values beyond 128 bits are refused).
    Int(i128),
    /// A float.
    Float(f64),
    /// A str.
    Str(Rc<str>),
    /// A bytes object.
    Bytes(Rc<[u8]>),
    /// A tuple.
    Tuple(Rc<Vec<Value>>),
    /// A list (shared and mutable, as in Python).
    List(Rc<RefCell<Vec<Value>>>),
    /// A dict, as its pairs in insertion order.
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

/// An object made by `REDUCE` or `NEWOBJ`: its class and arguments, never called, and the state
/// `BUILD` gave it.
#[derive(Debug)]
pub struct ObjectValue {
    pub(crate) class: Value,
    pub(crate) args: Value,
    /// The state set by `BUILD` (what `__setstate__` would receive).
    pub state: RefCell<Option<Value>>,
}

impl Value {
    /// The string, when the value is a str.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub(crate) fn as_int(&self) -> Option<i128> {
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

/// Why a pickle could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnpickleError(pub String);

impl std::fmt::Display for UnpickleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

type R<T> = Result<T, UnpickleError>;

/// An [`UnpickleError`] with `msg`.
pub fn err<T>(msg: impl Into<String>) -> R<T> {
    Err(UnpickleError(msg.into()))
}

/// Makes the values [`decode`] asks for. `V` is cloned for memo reads and `DUP`, so it should be a
/// handle (an `Rc`, an index). Strings and bytes are borrowed from the input (`'a`). A method that
/// gets a value of the wrong kind (`APPEND` on a dict) returns an error naming it.
pub trait Build<'a> {
    /// The value handle.
    type V: Clone;
    /// `None`.
    fn none(&mut self) -> Self::V;
    /// A bool.
    fn bool(&mut self, b: bool) -> Self::V;
    /// An int.
    fn int(&mut self, i: i128) -> Self::V;
    /// A float.
    fn float(&mut self, f: f64) -> Self::V;
    /// A str borrowed from the input.
    fn str(&mut self, s: &'a str) -> Self::V;
    /// A bytes object borrowed from the input.
    fn bytes(&mut self, b: &'a [u8]) -> Self::V;
    /// A tuple of `items` (also `FROZENSET`).
    fn tuple(&mut self, items: std::vec::Drain<'_, Self::V>) -> R<Self::V>;
    /// An empty list (also `EMPTY_SET`).
    fn empty_list(&mut self) -> R<Self::V>;
    /// An empty dict.
    fn empty_dict(&mut self) -> R<Self::V>;
    /// `list.extend(items)` (`APPEND`, `APPENDS`, `ADDITEMS`).
    fn append(&mut self, list: &Self::V, items: std::vec::Drain<'_, Self::V>) -> R<()>;
    /// `dict[k] = v` for each pair of `items` (an even count: key, value, key, value, ...).
    fn set_items(&mut self, dict: &Self::V, items: std::vec::Drain<'_, Self::V>) -> R<()>;
    /// `GLOBAL module name`.
    fn global(&mut self, module: &'a str, name: &'a str) -> Self::V;
    /// `STACK_GLOBAL`: the global named by two string values.
    fn stack_global(&mut self, module: Self::V, name: Self::V) -> R<Self::V>;
    /// `func(*args)` (`REDUCE`).
    fn call(&mut self, func: Self::V, args: Self::V) -> R<Self::V>;
    /// `cls.__new__(cls, *args)` (`NEWOBJ`, `NEWOBJ_EX` without its kwargs).
    fn new_obj(&mut self, class: Self::V, args: Self::V) -> R<Self::V>;
    /// `obj.__setstate__(state)` (`BUILD`); returns what then stands in for `obj`.
    fn build(&mut self, obj: Self::V, state: Self::V) -> R<Self::V>;
    /// A persistent id (`BINPERSID`, `PERSID`).
    fn pers_id(&mut self, pid: Self::V) -> R<Self::V>;
    /// In a split decode ([`decode_skipping`]): batch `batch` of the plan, decoded apart, holds
    /// the next items of `container` (a list, or a dict when `dict`). A builder that is never
    /// used for split decodes keeps this default, an error.
    fn splice(&mut self, container: &Self::V, batch: u32, dict: bool) -> R<()> {
        let _ = (container, batch, dict);
        err("this builder does not decode in parts")
    }
    /// In a split decode: memo key `idx`, set by another part and not a leaf. The builder returns
    /// a placeholder it resolves after merging the parts (from the values each part hands over),
    /// or an error.
    fn memo_ref(&mut self, idx: u32) -> R<Self::V> {
        err(format!("memo key {idx} is set by another part"))
    }
}

/// What a part of a split decode returns: its value (the main part's result, or a batch's
/// container), and its memo keys that other parts may refer to ([`Plan::exported`]), with their
/// values.
pub type PartValue<V> = (V, Vec<(u32, V)>);

/// A decoder's share of a split decode (`format::split`): the batches it skips (the main part
/// skips all, a batch decoder none), and the memo keys it does not hold, which it takes from the
/// plan's leaves.
struct Part<'p, 'a> {
    plan: &'p Plan<'a>,
    skip: &'p [Batch],
    /// The next batch to skip.
    next: usize,
    /// `prefix[k]`: memo keys set by `skip[..k]`.
    prefix: Vec<u32>,
    /// Memo keys below `base` are outside (a batch decoder's base is its batch's first key).
    base: u32,
    /// A batch decoder's end (the byte after its `APPENDS`/`SETITEMS`).
    end: usize,
}

impl Part<'_, '_> {
    /// The position of memo key `idx` in this decoder's own memo, or None when another part set it.
    #[inline]
    fn local(&self, idx: u32) -> Option<usize> {
        if idx < self.base {
            return None;
        }
        let k = self.skip.partition_point(|b| b.memo_base <= idx);
        if k > 0 {
            let b = &self.skip[k - 1];
            if idx - b.memo_base < b.memo_len {
                return None;
            }
        }
        Some((idx - self.base - self.prefix[k]) as usize)
    }
    /// Where this decoder next stops: the next batch to skip, or its own end.
    fn stop_at(&self) -> usize {
        self.skip.get(self.next).map_or(self.end, |b| b.start)
    }
}

struct Vm<'a, 'b, 'p, B: Build<'a>> {
    input: &'a [u8],
    pos: usize,
    /// Where `run` hands over to `Part` (`usize::MAX` for a whole decode): checked before each
    /// opcode.
    stop_at: usize,
    part: Option<Part<'p, 'a>>,
    b: &'b mut B,
    stack: Vec<B::V>,
    /// Stack positions of the open MARKs; values below the last one cannot be popped (`_pickle.c`'s
    /// fence).
    marks: Vec<usize>,
    /// Memo keys `0..len`, in the order every pickler assigns them; any other key (a hostile
    /// `LONG_BINPUT 4294967295`) goes into `sparse`, so a claimed index never sizes an allocation.
    memo: Vec<Option<B::V>>,
    sparse: HashMap<u32, B::V>,
    /// Number of memo keys set (`len(memo)`, which `MEMOIZE` uses as its index).
    memo_count: usize,
    /// The only opcodes accepted, when the pickle is read as a stricter unpickler reads it
    /// ([`WEIGHTS_ONLY_OPCODES`]); None: every opcode decoded here.
    allowed: Option<&'static [u8]>,
}

impl<'a, B: Build<'a>> Vm<'a, '_, '_, B> {
    #[inline]
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
    #[inline]
    fn arr<const N: usize>(&mut self) -> R<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    #[inline]
    fn u8(&mut self) -> R<u8> {
        Ok(self.take(1)?[0])
    }
    #[inline]
    fn u32(&mut self) -> R<u32> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> R<u64> {
        Ok(u64::from_le_bytes(self.arr()?))
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
    fn text(&mut self, n: usize) -> R<&'a str> {
        std::str::from_utf8(self.take(n)?).map_err(|_| UnpickleError("string is not UTF-8".into()))
    }
    #[inline]
    fn fence(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }
    #[inline]
    fn push(&mut self, v: B::V) {
        self.stack.push(v);
    }
    #[inline]
    fn pop(&mut self) -> R<B::V> {
        if self.stack.len() <= self.fence() {
            return err(if self.stack.is_empty() {
                "stack underflow"
            } else {
                "unexpected MARK on the stack"
            });
        }
        self.stack
            .pop()
            .ok_or_else(|| UnpickleError("stack underflow".into()))
    }
    #[inline]
    fn top(&self) -> R<&B::V> {
        match self.stack.last() {
            Some(v) if self.stack.len() > self.fence() => Ok(v),
            _ => err("stack underflow"),
        }
    }
    /// Closes the last MARK: the stack position of the first item above it.
    fn pop_mark(&mut self) -> R<usize> {
        self.marks
            .pop()
            .ok_or_else(|| UnpickleError("MARK missing".into()))
    }
    #[inline]
    fn memo_put(&mut self, idx: u32) -> R<()> {
        let v = self.top()?.clone();
        if self.part.is_some() {
            // The plan admits only keys set in order, once: this part's keys are dense.
            if idx as usize != self.memo_count {
                return err(format!("memo key {idx} out of order"));
            }
            self.memo.push(Some(v));
            self.memo_count += 1;
            return Ok(());
        }
        let i = idx as usize;
        if i < self.memo.len() {
            if self.memo[i].replace(v).is_none() {
                self.memo_count += 1;
            }
        } else if i == self.memo.len() {
            self.memo.push(Some(v));
            self.memo_count += 1;
        } else if self.sparse.insert(idx, v).is_none() {
            self.memo_count += 1;
        }
        Ok(())
    }
    #[inline]
    fn memo_get(&mut self, idx: u32) -> R<()> {
        let mut i = idx as usize;
        if let Some(part) = &self.part {
            match part.local(idx) {
                Some(local) => i = local,
                None => {
                    let v = match part.plan.leaf(idx) {
                        Some(LeafValue::None) => self.b.none(),
                        Some(LeafValue::Bool(x)) => self.b.bool(x),
                        Some(LeafValue::Int(x)) => self.b.int(x as i128),
                        Some(LeafValue::Str(s)) => self.b.str(s),
                        Some(LeafValue::Global(m, n)) => self.b.global(m, n),
                        None => self.b.memo_ref(idx)?,
                    };
                    self.push(v);
                    return Ok(());
                }
            }
        }
        let v = match self.memo.get(i) {
            Some(Some(v)) => v.clone(),
            _ => self
                .sparse
                .get(&idx)
                .cloned()
                .ok_or_else(|| UnpickleError(format!("memo key {idx} missing")))?,
        };
        self.push(v);
        Ok(())
    }
    fn list_op(&mut self, at: usize) -> R<()> {
        if at <= self.fence() || at > self.stack.len() {
            return err("APPEND(S) with no list on the stack");
        }
        let list = self.stack[at - 1].clone();
        self.b.append(&list, self.stack.drain(at..))
    }
    fn dict_op(&mut self, at: usize) -> R<()> {
        if at <= self.fence() || at > self.stack.len() {
            return err("SETITEM(S) with no dict on the stack");
        }
        if (self.stack.len() - at) % 2 != 0 {
            return err("SETITEMS with an odd item count");
        }
        let dict = self.stack[at - 1].clone();
        self.b.set_items(&dict, self.stack.drain(at..))
    }

    /// At `stop_at` in a split decode: a batch decoder returns its container; the main part
    /// hands the batch to the builder as a splice into the container below the batch's MARK
    /// (where its `APPENDS`/`SETITEMS` would have put the items), and jumps over it.
    fn hand_over(&mut self) -> R<Option<B::V>> {
        let Some(part) = &mut self.part else {
            return Ok(None);
        };
        let Some(&batch) = part.skip.get(part.next) else {
            if self.stack.len() != 1 || !self.marks.is_empty() {
                return err("a batch did not close where the plan says");
            }
            return self.pop().map(Some);
        };
        let k = part.next;
        part.next += 1;
        self.stop_at = part.stop_at();
        // The main part skips every batch of the plan: `k` is the batch's index there.
        let plan_index = u32::try_from(k).map_err(|_| UnpickleError("too many batches".into()))?;
        if self.stack.len() <= self.fence() {
            return err(if batch.dict {
                "SETITEM(S) with no dict on the stack"
            } else {
                "APPEND(S) with no list on the stack"
            });
        }
        let container = self.top()?.clone();
        self.b.splice(&container, plan_index, batch.dict)?;
        self.pos = batch.end;
        self.memo_count += batch.memo_len as usize;
        Ok(None)
    }

    /// After a split decode: this part's memo keys that other parts may refer to.
    fn exports(&mut self) -> Vec<(u32, B::V)> {
        let Some(part) = &self.part else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut k = 0;
        for (i, v) in std::mem::take(&mut self.memo).into_iter().enumerate() {
            // Dense position `i` -> memo key: after the batches this part skipped below it.
            let mut key = part.base as usize + i + part.prefix[k] as usize;
            while part
                .skip
                .get(k)
                .is_some_and(|b| b.memo_base as usize <= key)
            {
                k += 1;
                key = part.base as usize + i + part.prefix[k] as usize;
            }
            if let Some(v) = v.filter(|_| part.plan.exported(key)) {
                out.push((key as u32, v));
            }
        }
        out
    }

    fn run(&mut self) -> R<B::V> {
        // Every opcode consumes at least one byte and pushes at most one value: these bounds only
        // catch a builder or decoder bug, never a size the input could not pay for.
        loop {
            if self.pos == self.stop_at {
                if let Some(v) = self.hand_over()? {
                    return Ok(v);
                }
                continue;
            }
            let op = self.u8()?;
            if self.allowed.is_some_and(|a| !a.contains(&op)) {
                return err(format!(
                    "pickle opcode 0x{op:02x} at offset {}, which torch's weights-only unpickler \
                     refuses",
                    self.pos - 1
                ));
            }
            match op {
                0x80 => {
                    let proto = self.u8()?;
                    if proto > 5 {
                        return err(format!("unsupported pickle protocol {proto}"));
                    }
                }
                0x95 => {
                    // FRAME: only a framing hint, but CPython's unpickler reads the whole frame
                    // first (`_pickle.c` load_frame) and fails when the pickle is shorter.
                    let n = self.u64()?;
                    if n > (self.input.len() - self.pos) as u64 {
                        return err(format!(
                            "FRAME of {n} bytes at offset {} passes the end of the pickle",
                            self.pos - 9
                        ));
                    }
                }
                b'.' => return self.pop(),
                b'(' => self.marks.push(self.stack.len()),
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    let at = self.pop_mark()?;
                    self.stack.truncate(at);
                }
                b'2' => {
                    let v = self.top()?.clone();
                    self.push(v)
                }
                b'N' => {
                    let v = self.b.none();
                    self.push(v)
                }
                0x88 | 0x89 => {
                    let v = self.b.bool(op == 0x88);
                    self.push(v)
                }
                b'J' => {
                    let v = i32::from_le_bytes(self.arr()?);
                    let v = self.b.int(v as i128);
                    self.push(v)
                }
                b'K' => {
                    let v = self.u8()?;
                    let v = self.b.int(v as i128);
                    self.push(v)
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.arr()?);
                    let v = self.b.int(v as i128);
                    self.push(v)
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
                    let v = self.b.int(i128::from_le_bytes(buf));
                    self.push(v)
                }
                b'I' => {
                    let line = self.line()?;
                    let v = match line {
                        "01" => self.b.bool(true),
                        "00" => self.b.bool(false),
                        s => {
                            let i = s
                                .parse()
                                .map_err(|_| UnpickleError(format!("bad INT {s:?}")))?;
                            self.b.int(i)
                        }
                    };
                    self.push(v)
                }
                b'L' => {
                    let line = self.line()?;
                    let i = line
                        .trim_end_matches('L')
                        .parse()
                        .map_err(|_| UnpickleError(format!("bad LONG {line:?}")))?;
                    let v = self.b.int(i);
                    self.push(v)
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.arr()?);
                    let v = self.b.float(v);
                    self.push(v)
                }
                b'F' => {
                    let line = self.line()?;
                    let f = line
                        .parse()
                        .map_err(|_| UnpickleError(format!("bad FLOAT {line:?}")))?;
                    let v = self.b.float(f);
                    self.push(v)
                }
                b'X' | 0x8c | 0x8d => {
                    let n = match op {
                        0x8c => self.u8()? as usize,
                        b'X' => self.u32()? as usize,
                        _ => usize::try_from(self.u64()?).unwrap_or(usize::MAX),
                    };
                    let s = self.text(n)?;
                    let v = self.b.str(s);
                    self.push(v)
                }
                b'V' => {
                    let line = self.line()?;
                    let v = self.b.str(line);
                    self.push(v)
                }
                b'S' => {
                    let line = self.line()?;
                    let v = self.b.str(line.trim_matches(|c| c == '\'' || c == '"'));
                    self.push(v)
                }
                b'U' | b'T' | b'C' | b'B' | 0x8e | 0x96 => {
                    let n = match op {
                        b'U' | b'C' => self.u8()? as usize,
                        b'T' | b'B' => self.u32()? as usize,
                        _ => usize::try_from(self.u64()?).unwrap_or(usize::MAX),
                    };
                    let b = self.take(n)?;
                    // SHORT_BINSTRING/BINSTRING are py2 str: keep text when it is UTF-8.
                    let v = match std::str::from_utf8(b) {
                        Ok(s) if matches!(op, b'U' | b'T') => self.b.str(s),
                        _ => self.b.bytes(b),
                    };
                    self.push(v)
                }
                b')' => {
                    let at = self.stack.len();
                    let v = self.b.tuple(self.stack.drain(at..))?;
                    self.push(v)
                }
                b't' | 0x91 => {
                    let at = self.pop_mark()?;
                    let v = self.b.tuple(self.stack.drain(at..))?;
                    self.push(v)
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < self.fence() + n {
                        return err("stack underflow");
                    }
                    let at = self.stack.len() - n;
                    let v = self.b.tuple(self.stack.drain(at..))?;
                    self.push(v)
                }
                b']' | 0x8f => {
                    let v = self.b.empty_list()?;
                    self.push(v)
                }
                b'l' => {
                    let at = self.pop_mark()?;
                    let v = self.b.empty_list()?;
                    self.stack.insert(at, v);
                    self.list_op(at + 1)?
                }
                b'}' => {
                    let v = self.b.empty_dict()?;
                    self.push(v)
                }
                b'd' => {
                    let at = self.pop_mark()?;
                    let v = self.b.empty_dict()?;
                    self.stack.insert(at, v);
                    self.dict_op(at + 1)?
                }
                b'a' => {
                    if self.stack.len() < self.fence() + 2 {
                        return err("stack underflow");
                    }
                    self.list_op(self.stack.len() - 1)?
                }
                b'e' | 0x90 => {
                    let at = self.pop_mark()?;
                    self.list_op(at)?
                }
                b's' => {
                    if self.stack.len() < self.fence() + 3 {
                        return err("stack underflow");
                    }
                    self.dict_op(self.stack.len() - 2)?
                }
                b'u' => {
                    let at = self.pop_mark()?;
                    self.dict_op(at)?
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
                    let idx = u32::try_from(self.memo_count)
                        .map_err(|_| UnpickleError("memo too large".into()))?;
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
                    let module = self.line()?;
                    let name = self.line()?;
                    let v = self.b.global(module, name);
                    self.push(v)
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let v = self.b.stack_global(module, name)?;
                    self.push(v)
                }
                b'i' => {
                    // INST: find_class(module, name)(*items since MARK) (pickle.py `load_inst`).
                    let module = self.line()?;
                    let name = self.line()?;
                    let class = self.b.global(module, name);
                    let at = self.pop_mark()?;
                    let args = self.b.tuple(self.stack.drain(at..))?;
                    let v = self.b.call(class, args)?;
                    self.push(v)
                }
                b'o' => {
                    // OBJ: the first item since MARK called with the others (`load_obj`).
                    let at = self.pop_mark()?;
                    if self.stack.len() <= at {
                        return err("OBJ without a class");
                    }
                    let class = self.stack.remove(at);
                    let args = self.b.tuple(self.stack.drain(at..))?;
                    let v = self.b.call(class, args)?;
                    self.push(v)
                }
                b'R' => {
                    let args = self.pop()?;
                    let func = self.pop()?;
                    let v = self.b.call(func, args)?;
                    self.push(v)
                }
                0x81 | 0x92 => {
                    if op == 0x92 {
                        self.pop()?; // kwargs
                    }
                    let args = self.pop()?;
                    let class = self.pop()?;
                    let v = self.b.new_obj(class, args)?;
                    self.push(v)
                }
                b'b' => {
                    let state = self.pop()?;
                    let obj = self.pop()?;
                    let v = self.b.build(obj, state)?;
                    self.push(v)
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let v = self.b.pers_id(pid)?;
                    self.push(v)
                }
                b'P' => {
                    let line = self.line()?;
                    let pid = self.b.str(line);
                    let v = self.b.pers_id(pid)?;
                    self.push(v)
                }
                0x97 => {} // READONLY_BUFFER: no-op on our values
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

/// Decodes one pickle from `input`, making its values with `b`; returns the value `STOP` pops.
///
/// Errors: [`UnpickleError`] for malformed or truncated input, unsupported opcodes (`EXT*`,
/// out-of-band buffers) and the builder's errors.
pub fn decode<'a, B: Build<'a>>(input: &'a [u8], b: &mut B) -> Result<B::V, UnpickleError> {
    decode_with_len(input, b).map(|(v, _)| v)
}

/// [`decode`], also returning the pickle's length: the bytes through its `STOP` opcode. What
/// follows is never read (Python's `pickle.load` stops there too).
///
/// Errors: as [`decode`].
pub fn decode_with_len<'a, B: Build<'a>>(
    input: &'a [u8],
    b: &mut B,
) -> Result<(B::V, usize), UnpickleError> {
    decode_with(input, b, None)
}

fn decode_with<'a, B: Build<'a>>(
    input: &'a [u8],
    b: &mut B,
    allowed: Option<&'static [u8]>,
) -> Result<(B::V, usize), UnpickleError> {
    let mut vm = Vm {
        input,
        pos: 0,
        stop_at: usize::MAX,
        part: None,
        b,
        stack: Vec::new(),
        marks: Vec::new(),
        // About one memo entry per 16 input bytes in torch's pickles (MEMOIZE after nearly every
        // value): reserved up front, so a large memo is not copied as it grows (untouched pages of
        // an over-estimate cost no memory).
        memo: super::reserved(input.len() / 16),
        sparse: HashMap::new(),
        memo_count: 0,
        allowed,
    };
    let v = vm.run()?;
    Ok((v, vm.pos))
}

/// The main part of a split decode: decodes `input` like [`decode`], but hands each batch of
/// `plan` to the builder ([`Build::splice`]) instead of decoding it; [`decode_batch`] decodes
/// them. A memo reference into a batch is answered from the plan's leaves, or else by the
/// builder's [`Build::memo_ref`]. Returns the pickle's value and this part's exported memo keys,
/// and the pickle's length ([`decode_with_len`]).
///
/// Errors: as [`decode`]; also those of `splice` and `memo_ref`.
pub fn decode_skipping<'a, B: Build<'a>>(
    input: &'a [u8],
    b: &mut B,
    plan: &Plan<'a>,
) -> Result<(PartValue<B::V>, usize), UnpickleError> {
    let mut prefix = Vec::with_capacity(plan.batches.len() + 1);
    let mut n = 0u32;
    prefix.push(0);
    for batch in &plan.batches {
        n = n
            .checked_add(batch.memo_len)
            .ok_or_else(|| UnpickleError("memo too large".into()))?;
        prefix.push(n);
    }
    let part = Part {
        plan,
        skip: &plan.batches,
        next: 0,
        prefix,
        base: 0,
        end: usize::MAX,
    };
    let mut vm = Vm {
        input,
        pos: 0,
        stop_at: part.stop_at(),
        part: Some(part),
        b,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Vec::new(),
        sparse: HashMap::new(),
        memo_count: 0,
        allowed: None,
    };
    let v = vm.run()?;
    Ok(((v, vm.exports()), vm.pos))
}

/// Decodes batch `k` of `plan` on its own: an empty list (dict) stands in for its container, and
/// is returned holding the batch's items, with the batch's exported memo keys. Memo references
/// out of the batch are answered from the plan's leaves, or else by [`Build::memo_ref`].
///
/// Errors: as [`decode`]; also those of `memo_ref`.
pub fn decode_batch<'a, B: Build<'a>>(
    input: &'a [u8],
    b: &mut B,
    plan: &Plan<'a>,
    k: usize,
) -> Result<PartValue<B::V>, UnpickleError> {
    let batch = plan.batches[k];
    let container = if batch.dict {
        b.empty_dict()?
    } else {
        b.empty_list()?
    };
    let part = Part {
        plan,
        skip: &[],
        next: 0,
        prefix: vec![0],
        base: batch.memo_base,
        end: batch.end,
    };
    let mut vm = Vm {
        input,
        pos: batch.start,
        stop_at: batch.end,
        part: Some(part),
        b,
        stack: vec![container],
        marks: Vec::new(),
        memo: Vec::with_capacity(batch.memo_len as usize),
        sparse: HashMap::new(),
        memo_count: batch.memo_base as usize,
        allowed: None,
    };
    let v = vm.run()?;
    Ok((v, vm.exports()))
}

/// Builds the symbolic [`Value`] graph, and keeps every mutable container so that the cycles a
/// hostile pickle builds (a list appended to itself) can be broken.
#[derive(Default)]
struct Symbolic {
    arena: Vec<Value>,
}

impl Symbolic {
    fn keep(&mut self, v: Value) -> Value {
        self.arena.push(v.clone());
        v
    }
}

impl<'a> Build<'a> for Symbolic {
    type V = Value;
    fn none(&mut self) -> Value {
        Value::None
    }
    fn bool(&mut self, b: bool) -> Value {
        Value::Bool(b)
    }
    fn int(&mut self, i: i128) -> Value {
        Value::Int(i)
    }
    fn float(&mut self, f: f64) -> Value {
        Value::Float(f)
    }
    fn str(&mut self, s: &'a str) -> Value {
        Value::Str(Rc::from(s))
    }
    fn bytes(&mut self, b: &'a [u8]) -> Value {
        Value::Bytes(Rc::from(b))
    }
    fn tuple(&mut self, items: std::vec::Drain<'_, Value>) -> R<Value> {
        Ok(Value::Tuple(Rc::new(items.collect())))
    }
    fn empty_list(&mut self) -> R<Value> {
        Ok(self.keep(Value::List(Rc::new(RefCell::new(Vec::new())))))
    }
    fn empty_dict(&mut self) -> R<Value> {
        Ok(self.keep(Value::Dict(Rc::new(RefCell::new(Vec::new())))))
    }
    fn append(&mut self, list: &Value, items: std::vec::Drain<'_, Value>) -> R<()> {
        match list {
            Value::List(l) => {
                l.borrow_mut().extend(items);
                Ok(())
            }
            other => err(format!("APPEND(S) on a {}", other.kind())),
        }
    }
    fn set_items(&mut self, dict: &Value, mut items: std::vec::Drain<'_, Value>) -> R<()> {
        match dict {
            Value::Dict(d) => {
                let mut d = d.borrow_mut();
                while let (Some(k), Some(v)) = (items.next(), items.next()) {
                    d.push((k, v));
                }
                Ok(())
            }
            other => err(format!("SETITEM(S) on a {}", other.kind())),
        }
    }
    fn global(&mut self, module: &'a str, name: &'a str) -> Value {
        Value::Global(Rc::new((module.to_string(), name.to_string())))
    }
    fn stack_global(&mut self, module: Value, name: Value) -> R<Value> {
        match (module.as_str(), name.as_str()) {
            (Some(m), Some(n)) => Ok(Value::Global(Rc::new((m.to_string(), n.to_string())))),
            _ => err("STACK_GLOBAL needs two strings"),
        }
    }
    fn call(&mut self, func: Value, args: Value) -> R<Value> {
        Ok(Value::Call(Rc::new((func, args))))
    }
    fn new_obj(&mut self, class: Value, args: Value) -> R<Value> {
        Ok(self.keep(Value::Object(Rc::new(ObjectValue {
            class,
            args,
            state: RefCell::new(None),
        }))))
    }
    fn build(&mut self, obj: Value, state: Value) -> R<Value> {
        match &obj {
            Value::Object(o) => {
                *o.state.borrow_mut() = Some(state);
                Ok(obj)
            }
            // BUILD on a call result (e.g. an object from copyreg): keep it as an object.
            other => Ok(self.keep(Value::Object(Rc::new(ObjectValue {
                class: other.clone(),
                args: Value::Tuple(Rc::new(Vec::new())),
                state: RefCell::new(Some(state)),
            })))),
        }
    }
    fn pers_id(&mut self, pid: Value) -> R<Value> {
        Ok(Value::PersId(Rc::new(pid)))
    }
}

/// Reads one pickle from `input` as data.
///
/// Errors: [`UnpickleError`] for malformed or truncated input, unsupported opcodes (`EXT*`,
/// out-of-band buffers).
pub fn unpickle(input: &[u8]) -> Result<Unpickled, UnpickleError> {
    unpickle_with(input, None)
}

/// The opcodes torch's weights-only unpickler reads (`torch/_weights_only_unpickler.py`, the same
/// set in torch 2.3.1 and 2.15.0), which reads every tensor item of a DCP checkpoint from torch
/// 2.4 on (`FileSystemReader.read_data`): PROTO, STOP, GLOBAL, NEWOBJ, REDUCE, BUILD, APPEND(S),
/// SETITEM(S), MARK, TUPLE(1/2/3), NONE, NEWTRUE/NEWFALSE, EMPTY_TUPLE/LIST/DICT/SET,
/// BININT(1/2), BINFLOAT, BINUNICODE, SHORT_BINSTRING, BINPERSID, (LONG_)BINGET, (LONG_)BINPUT,
/// LONG1. torch.save's own protocol 1, 4 and 5 pickles fall outside it.
pub const WEIGHTS_ONLY_OPCODES: &[u8] = &[
    0x80, b'.', b'c', 0x81, b'R', b'b', b'a', b'e', b's', b'u', b'(', b't', 0x85, 0x86, 0x87, b'N',
    0x89, 0x88, b')', b']', b'}', 0x8f, b'J', b'K', b'M', b'G', b'X', b'U', b'Q', b'h', b'j', b'q',
    b'r', 0x8a,
];

/// [`unpickle`] accepting only the opcodes torch's weights-only unpickler reads
/// ([`WEIGHTS_ONLY_OPCODES`]): how a tensor item must be pickled for every torch to load it.
///
/// Errors: as [`unpickle`], and any other opcode.
pub fn unpickle_weights_only(input: &[u8]) -> Result<Unpickled, UnpickleError> {
    unpickle_with(input, Some(WEIGHTS_ONLY_OPCODES))
}

fn unpickle_with(input: &[u8], allowed: Option<&'static [u8]>) -> Result<Unpickled, UnpickleError> {
    let mut b = Symbolic::default();
    let result = decode_with(input, &mut b, allowed).map(|(v, _)| v);
    // Whatever happened, the arena ends up in an Unpickled, whose Drop breaks its cycles.
    let mut out = Unpickled {
        root: Value::None,
        arena: b.arena,
    };
    out.root = result?;
    Ok(out)
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
            // Nothing below the last MARK can be popped or appended to (`_pickle.c`'s fence).
            b"K\x01(0.",
            b"](K\x01a.",
            b"}(K\x01K\x02s.",
            b"K\x01(\x85.",
            b"(b.",
        ] {
            assert!(unpickle(input).is_err(), "{input:?}");
        }
        // Memo keys far apart cost one entry each, not the span between them.
        let mut far = b"\x80\x02N".to_vec();
        for i in 0..100_000u32 {
            far.push(b'r');
            far.extend_from_slice(&(i * 40_000).to_le_bytes());
        }
        far.extend_from_slice(b"j\x00\x35\x0c\x00.");
        assert!(matches!(*unpickle(&far).unwrap(), Value::None));
    }
}
